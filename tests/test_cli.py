"""The `sparkchat` command: dispatch, --version, every --help quick (no torch) and showing defaults, and a
terminal chat over a real (tiny, random) model directory."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sparkchat.cli import COMMANDS, version

ROOT = Path(__file__).resolve().parent.parent

# pipeline/probe.py imports torch at module level and its flags have no help text until the probe
# rewrite lands; then these marks turn into XPASS failures and must go.


def sparkchat(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparkchat", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, **kw)


def flags_without_default(help_text: str) -> list[str]:
    """The options whose --help entry does not say its default (-h and --version excepted)."""
    entries = re.split(r"\n  (?=-)", help_text.split("options:", 1)[1])[1:]
    flags = [e.split()[0].rstrip(",") for e in entries if "default" not in e]
    return [f for f in flags if f not in ("-h", "--version")]


def test_version_is_the_package_version():
    r = sparkchat("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"sparkchat {version()}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "(.+)"', pyproject, re.M).group(1) == version()


def test_help_lists_the_commands():
    r = sparkchat("--help")
    assert r.returncode == 0
    for name in COMMANDS:
        assert re.search(rf"^  {name} ", r.stdout, re.M), name


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_command_help_shows_every_default(cmd):
    r = sparkchat(cmd, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: sparkchat {cmd}")
    assert flags_without_default(r.stdout) == []


def test_flags_without_default_finds_one():  # the check above can fail
    text = "usage: x\n\noptions:\n  -h, --help  show\n  --a A       thing (default: 1)\n  --b B       other\n"
    assert flags_without_default(text) == ["--b"]


HEAVY = ("torch", "fastapi", "gradio", "uvicorn", "transformer_engine", "transformers")


@pytest.mark.parametrize("cmd", ["", *COMMANDS])
def test_help_imports_nothing_heavy(cmd):
    """`--help` must answer at once: parsing it loads none of the heavy packages (checked, not timed)."""
    argv = [cmd, "--help"] if cmd else ["--help"]
    code = (f"import sys\nfrom sparkchat.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-300:]


def test_unknown_or_missing_command_is_an_error():
    r = sparkchat("trian")
    assert r.returncode == 2 and "invalid choice: 'trian'" in r.stderr
    r = sparkchat()
    assert r.returncode == 2 and f"a command is needed: {', '.join(COMMANDS)}" in r.stderr


def test_chat_command_answers_and_exits(serve_model_dir):
    r = sparkchat("chat", "--model", str(serve_model_dir), "--max-tokens", "5", "--temperature", "0",
                  input="Hello there\nWhat is 2 + 2?\n/clear\nCafé?\n")
    assert r.returncode == 0, r.stderr
    assert "type a message" in r.stderr
    _, hello, sum_, cleared, cafe, bye = r.stdout.split("> ")  # a prompt per line read, and one at the end
    assert all(reply.strip() and reply.endswith("\n") for reply in (hello, sum_, cafe))
    assert cleared == "" and bye == "\n"


def test_chat_command_names_a_missing_model(tmp_path):
    r = sparkchat("chat", "--model", str(tmp_path), input="")
    assert r.returncode == 2 and "is not a sparkchat model directory: config.json is missing" in r.stderr


def run_main(argv: list[str], cwd: Path = ROOT) -> tuple[str, list[str]]:
    """`sparkchat ARGV` in a fresh interpreter, stopped at its first exit: (what it said, the heavy
    packages it had imported by then). A check made before any of them loaded is made before the model
    would load, since loading takes torch."""
    code = (f"import sys\nfrom sparkchat.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as e:\n"
            f"    print('exit:', e.code, file=sys.stderr)\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree's code, from any folder
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stderr, eval(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cmd", ["serve", "chat"])
def test_no_model_says_what_to_run_before_anything_loads(cmd, tmp_path):
    """In a clone where nothing was trained: the default model directory is not there."""
    said, heavy = run_main([cmd], cwd=tmp_path)
    assert "no model at artifacts/model" in said and "`make repro`" in said and "--model DIR" in said, said
    assert str(tmp_path) in said  # a relative path, said with the folder it is relative to
    assert heavy == []
    said, heavy = run_main([cmd, "--model", str(tmp_path / "elsewhere")])
    assert f"the model directory {tmp_path / 'elsewhere'} does not exist: pass --model" in said and heavy == []


def test_a_busy_port_is_said_before_the_model_loads(serve_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        said, heavy = run_main(["serve", "--model", str(serve_model_dir), "--port", str(port)])
    assert f"sparkchat serve: port {port} on 127.0.0.1 is in use" in said and "--port" in said, said
    assert heavy == []  # said before torch, FastAPI or the model loaded
    said, _ = run_main(["serve", "--model", str(serve_model_dir), "--port", "70000"])
    assert "--port must be in [0, 65535], got 70000" in said


@pytest.mark.parametrize("cmd", ["serve", "chat"])
def test_a_device_this_machine_lacks_is_said_before_the_model_loads(cmd, serve_model_dir):
    """`--device cuda` on a machine without a GPU, or a misspelt device: one line naming the flag and
    what is wrong, before any port opens or the model loads (the server used to open its port and
    answer "failed to load" for ever)."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    for device, why in [("cuda", "torch sees no CUDA GPU here"), ("cdua", "'cdua' is not a torch device")]:
        port = ["--port", "0"] if cmd == "serve" else []
        said, _ = run_main([cmd, "--model", str(serve_model_dir), "--device", device, *port])
        assert f"--device '{device}'" in said and why in said and "Traceback" not in said, said
        assert "exit: 0" not in said and "Started server process" not in said


def test_chat_says_a_line_that_is_not_utf8_and_goes_on(serve_model_dir):
    r = subprocess.run([sys.executable, "-m", "sparkchat", "chat", "--model", str(serve_model_dir), "--max-tokens", "3"],
                       input=b"Hello\ncaf\xe9?\nWhat is 2 + 2?\n", capture_output=True, cwd=ROOT, timeout=120)
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0, err
    assert "that line was not sent: byte 0xe9 at character 4 is not UTF-8" in err, err
    _, hello, skipped, sum_, bye = out.split("> ")  # a reply to the lines around it, none to it
    assert hello.strip() and sum_.strip() and skipped == "" and bye == "\n"
    r = subprocess.run([sys.executable, "-m", "sparkchat", "chat", "--model", str(serve_model_dir), "--system",
                        b"Be \xff brief"], input=b"", capture_output=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "--system: byte 0xff at character 4 is not UTF-8" in r.stderr.decode()


def test_chat_history_drops_old_turns_keeping_the_system_prompt(serve_tokenizer):
    from model.chat import fit_history, render
    tok = serve_tokenizer
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(12):
        msgs += [{"role": "user", "content": f"Question number {i} about the sea?"},
                 {"role": "assistant", "content": f"Answer number {i} about the sea."}]
    msgs.append({"role": "user", "content": "Last question?"})
    full, _ = render(tok, msgs, for_completion=True)
    budget = len(full) // 2
    ids, kept, dropped = fit_history(tok, msgs, budget)
    assert len(ids) <= budget and dropped > 0 and dropped % 2 == 0
    assert kept[0] == msgs[0] and kept[-1] == msgs[-1] and kept[1]["role"] == "user"
    assert ids == render(tok, kept, for_completion=True)[0] and ids[0] == tok.bos_id
    assert fit_history(tok, msgs, len(full)) == (full, msgs, 0)  # fits: nothing dropped


def test_chat_command_shows_a_calculator_use_on_a_line_of_its_own(conv_tool_model_dir):
    r = sparkchat("chat", "--model", str(conv_tool_model_dir), input="What is 37 + 58?\n")
    assert r.returncode == 0, r.stderr
    _, reply, bye = r.stdout.split("> ")
    assert reply == "  calculator: 37 + 58 → 95\n37 + 58 = 95\n" and bye == "\n"  # not "`37 + 58 = 95`37 + 58 = 95"


def test_chat_history_keeps_the_reply_parts(conv_tool_model_dir, conv_tool_chats):
    """The next turn's prompt holds the calculator call, its result and the answer line as the model
    wrote them, not the words shown."""
    import io

    from model.chat import render
    from model.chat_engine import chat_engine
    from model.requests import sampling_params
    from model.model_dir import load_model_dir
    from sparkchat.chat import answer
    model, tok, gen = load_model_dir(conv_tool_model_dir)
    engine = chat_engine(model, tok, gen, max_batch=1)
    prompts, submit = [], engine.submit
    engine.submit = lambda ids, *a: (prompts.append(list(ids)), submit(ids, *a))[1]  # record, then submit
    question, trained = conv_tool_chats[1]
    hello = {"role": "user", "content": "Hello!"}
    try:
        out = io.StringIO()
        history = answer(engine, tok, [question], sampling_params(gen), out)
        assert out.getvalue() == "We need \n  calculator: 12 + 30 → 42\n12 + 30 = 42.\n"
        assert history == [question, trained]
        history = answer(engine, tok, history + [hello], sampling_params(gen), io.StringIO())
    finally:
        engine.shutdown()
    assert prompts[1] == render(tok, [question, trained, hello], for_completion=True)[0]
    assert history[:3] == [question, trained, hello] and history[3]["role"] == "assistant"


def test_chat_p_answers_one_message_and_exits(conv_tool_model_dir):
    """`sparkchat chat -p TEXT`: the reply alone on stdout, nothing read from stdin, exit 0."""
    r = sparkchat("chat", "--model", str(conv_tool_model_dir), "-p", "What is 37 + 58?", input="ignored\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "  calculator: 37 + 58 → 95\n37 + 58 = 95\n"
    assert "type a message" not in r.stderr
    r = sparkchat("chat", "--model", str(conv_tool_model_dir), "-p", "  ")
    assert r.returncode == 2 and "--prompt: the message is empty" in r.stderr


def long_reply_model_dir(src: Path, dest: Path) -> Path:
    """The model at `src` saved again with generation.json's reply budget (256) over its context (128),
    as the pipeline's chat model has it."""
    from model.model_dir import load_model_dir, save_model_dir
    model, tok, gen = load_model_dir(src)
    save_model_dir(dest, model, tok, dict(gen, max_tokens=256))
    return dest


def test_chat_history_fills_the_context_less_the_replys_share(conv_tool_model_dir, tmp_path):
    """With a reply budget over the context, six turns keep every earlier exchange that fits beside a
    quarter of the context for the reply: an exchange is dropped only when the prompt would pass that."""
    import io

    from model.chat import render
    from model.chat_engine import chat_engine
    from model.requests import sampling_params
    from model.model_dir import load_model_dir
    from sparkchat.chat import REPLY_SHARE, answer
    model, tok, gen = load_model_dir(long_reply_model_dir(conv_tool_model_dir, tmp_path / "m"))
    engine = chat_engine(model, tok, gen, max_batch=1)
    prompts, submit = [], engine.submit
    engine.submit = lambda ids, *a: (prompts.append(list(ids)), submit(ids, *a))[1]  # record, then submit
    budget = engine.max_len - engine.max_len // REPLY_SHARE
    every, history = [], []
    try:
        for _ in range(6):
            every.append({"role": "user", "content": "Hello!"})
            history = answer(engine, tok, history + [every[-1]], sampling_params(gen), io.StringIO())
            every.append(history[-1])
            sent = len(history) - 1  # the messages the prompt held
            assert len(prompts[-1]) <= budget
            if sent < len(every) - 1:  # one exchange more would not have fit
                assert len(render(tok, every[-sent - 3:-1], for_completion=True)[0]) > budget
    finally:
        engine.shutdown()
    assert len(every) == 12 and max(map(len, prompts)) > engine.max_len // 2  # more than half the context held


def test_chat_piped_is_plain_text(conv_tool_model_dir, tmp_path):
    """Six turns piped in, stdout and stderr piped out: the replies and the note that the conversation
    outgrew the context carry no terminal escape codes."""
    path = long_reply_model_dir(conv_tool_model_dir, tmp_path / "m")
    r = sparkchat("chat", "--model", str(path), input="What is 37 + 58?\n" + "Hello!\n" * 5)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("calculator: 37 + 58 → 95") == 1 and len(r.stdout.split("> ")) == 8
    assert "\033" not in r.stdout + r.stderr


def test_chat_offers_tools_shows_a_call_and_takes_the_next_line_as_its_result(conv_call_model_dir, tmp_path):
    """--tools FILE: the model that learned to call get_weather calls it, the call shows on a line of its own,
    the next line read is its result (prompted `result> `), and the model answers with it."""
    import json

    from conftest import CONV_FUNCTIONS
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": f} for f in CONV_FUNCTIONS]))
    r = sparkchat("chat", "--model", str(conv_call_model_dir), "--tools", str(tools), input="Weather in Paris?\n21\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == '>   call: get_weather {"city": "Paris"}\nresult> It is 21 in Paris.\n> \n'
    r = sparkchat("chat", "--model", str(conv_call_model_dir), "--tools", str(tools), "-p", "Weather in Paris?")
    assert r.stdout == '  call: get_weather {"city": "Paris"}\n'
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "a b"}}]))
    r = sparkchat("chat", "--model", str(conv_call_model_dir), "--tools", str(tools), "-p", "Hi")
    assert r.returncode == 2 and "--tools[0].function.name" in r.stderr
    tools.write_text("[{")
    r = sparkchat("chat", "--model", str(conv_call_model_dir), "--tools", str(tools), "-p", "Hi")
    assert r.returncode == 2 and "--tools:" in r.stderr and "is not JSON" in r.stderr
