"""Export to Hugging Face transformers and back (model/hf.py, pipeline/export.py), checked with transformers
itself on CPU: the exported NanoChatForCausalLM computes sparkchat's logits and greedy tokens, its chat
template gives render's ids, AutoTokenizer round-trips text, a NanoChat directory made by transformers
loads into sparkchat and is served by `sparkchat serve` to the openai client."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from model.chat import ChatFormatError, render
from model.chat_engine import chat_engine
from model.requests import SamplingParams, Token
from model.model_dir import ModelDirError, load_model_dir, save_model_dir, verify_model_dir
from sparkchat import paths

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
GEN = {"temperature": 0.8, "top_k": 20, "top_p": 0.95, "max_tokens": 16, "tool_use": True}
PROMPTS = ["Hello! How are you today?", "The quick brown fox jumps over the lazy dog.",
           "What is 12 + 30? It is 42.", "Café, naïve, résumé; 你好世界 🙂", "A"]
CALC = [{"type": "text", "text": "Let me compute "}, {"type": "python", "text": "12+30"},
        {"type": "python_output", "text": "42"}, {"type": "text", "text": " so it is 42."}]
CONVERSATIONS = [
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hello! How are you today?"}],
    [{"role": "system", "content": "Answer in French.\nAlways."}, {"role": "user", "content": "What is 12 + 30?"},
     {"role": "assistant", "content": "It is 42."}, {"role": "user", "content": "And   12 + 31?  "}],
    [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 12+30?"},
     {"role": "assistant", "content": CALC}, {"role": "user", "content": "Thanks! 🙂"}],
    [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "kind."}]},
     {"role": "user", "content": [{"type": "text", "text": "Café, naïve, "}, {"type": "text", "text": "résumé"}]},
     {"role": "assistant", "content": "你好世界"}, {"role": "user", "content": "\n\nnewlines\n"},
     {"role": "assistant", "content": ""}, {"role": "user", "content": "last"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": CALC},
     {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}],  # ends with the assistant
]


def template_ids(hf_tok, conv, add_generation_prompt: bool) -> list[int]:
    return list(hf_tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                                           return_dict=True)["input_ids"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory, serve_model, serve_tokenizer):
    """The tiny serving model saved as a sparkchat directory and exported by `sparkchat export`'s code."""
    from pipeline.export import main
    root = tmp_path_factory.mktemp("hf_export")
    save_model_dir(root / "model", serve_model, serve_tokenizer, GEN)
    main(["--model", str(root / "model"), "--out", str(root / "hf")])
    return root / "hf"


@pytest.fixture(scope="module")
def hf_model(exported):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert type(model).__name__ == "NanoChatForCausalLM" and model.dtype == torch.float32
    assert not any(info.values()), info  # every weight found, none left over
    return model.eval()


@pytest.fixture(scope="module")
def hf_tok(exported):
    return transformers.AutoTokenizer.from_pretrained(exported)


def test_export_writes_a_transformers_directory_sparkchat_can_verify(exported, tmp_path):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "README.md", "checksums.json"} <= names
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "nanochat" and config["architectures"] == ["NanoChatForCausalLM"]
    assert "chat_template" in json.loads((exported / "tokenizer_config.json").read_text())
    verify_model_dir(exported)
    damaged = shutil.copytree(exported, tmp_path / "damaged")
    with open(damaged / "model.safetensors", "r+b") as f:  # checksums.json covers the export too
        f.seek(-100, 2)
        f.write(b"\xff")
    with pytest.raises(ModelDirError, match="model.safetensors does not match"):
        load_model_dir(damaged)


def test_logits_equal_sparkchat(hf_model, serve_model, serve_tokenizer):
    for text in PROMPTS:
        ids = torch.tensor([[serve_tokenizer.bos_id] + serve_tokenizer.encode(text)])
        with torch.no_grad():
            ours, theirs = serve_model(ids), hf_model(ids).logits
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() <= 1e-5, text


def test_greedy_generation_identical(hf_model, serve_model, serve_tokenizer):
    tok = serve_tokenizer
    engine = chat_engine(serve_model, tok, GEN, max_batch=4)
    try:
        for text in PROMPTS:
            prompt = render(tok, [{"role": "user", "content": text}], for_completion=True)[0]
            ours, done = [], threading.Event()
            engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=32),
                          lambda ev: ours.append(ev.id) if isinstance(ev, Token) else done.set())
            assert done.wait(60)
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32)
            theirs = out[0, len(prompt):].tolist()
            assert len(ours) == 32 and ours == theirs, text
    finally:
        engine.shutdown()


def test_generate_stops_after_a_calculator_call(exported, hf_model, serve_tokenizer):
    """transformers' generate runs no tool, so the export's generation_config stops it at <|python_end|>
    (the caller runs the call and goes on) instead of letting the model write the result itself. The reply
    is steered into a call (`prefix_allowed_tokens_fn`), then left free: nothing comes after the call's end."""
    tok, s = serve_tokenizer, serve_tokenizer.special
    prompt = render(tok, [{"role": "user", "content": "What is 37 + 58?"}], for_completion=True)[0]
    call = [s["<|python_start|>"], *tok.encode("37 + 58"), s["<|python_end|>"]]
    every = list(range(tok.vocab_size))

    def steer(_, ids):
        made = len(ids) - len(prompt)
        return [call[made]] if made < len(call) else every

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                prefix_allowed_tokens_fn=steer)
    assert out[0, len(prompt):].tolist() == call
    stops = transformers.GenerationConfig.from_pretrained(exported).eos_token_id
    assert sorted(stops) == sorted(s[t] for t in ("<|assistant_end|>", "<|bos|>", "<|python_end|>"))
    assert "stops at `<|assistant_end|>` or `<|bos|>` or `<|python_end|>`" in (exported / "README.md").read_text()


def test_chat_template_renders_what_render_renders(hf_tok, serve_tokenizer):
    for conv in CONVERSATIONS:
        prompt = conv[-1]["role"] == "user"
        assert template_ids(hf_tok, conv, prompt) == render(serve_tokenizer, conv, for_completion=prompt)[0]
        if prompt:
            assert template_ids(hf_tok, conv, False) == render(serve_tokenizer, conv)[0]
    # what render refuses, the template refuses
    for conv, gen_prompt in ([[{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], False],
                             [CONVERSATIONS[4], True]):
        with pytest.raises(ChatFormatError):
            render(serve_tokenizer, conv, for_completion=gen_prompt)
        with pytest.raises(Exception, match="system message may only come first|last message must come from the user"):
            template_ids(hf_tok, conv, gen_prompt)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "array", "items": {"type": ["integer", "null"]}}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
CALL = {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}


def test_chat_template_renders_tools_and_calls_as_render_does(exported, hf_tok, serve_tokenizer):
    """transformers' form of function calling (tools=..., an assistant's tool_calls, tool messages) gives the ids
    render gives for the same conversation in sparkchat's form (functions, call parts, tool messages)."""
    from model.tools import call_text
    ours = [{"name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS]
    call_part = {"type": "call", "text": call_text(CALL["name"], CALL["arguments"])}
    convs = [  # (transformers' messages, sparkchat's messages)
        ([{"role": "user", "content": "Weather in Zürich?"}],) * 2,
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],) * 2,
        ([{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Let me see.",
                                                    "tool_calls": [{"type": "function", "function": CALL}]},
          {"role": "tool", "content": "21"}],
         [{"role": "user", "content": "Weather?"},
          {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}, call_part]},
          {"role": "tool", "content": "21"}]),
    ]
    for hf_conv, conv in convs:
        want = render(serve_tokenizer, conv, for_completion=True, tools=ours)[0]
        assert tool_template_ids(hf_tok, hf_conv, TOOLS) == want  # transformers' tools entries
        assert tool_template_ids(hf_tok, hf_conv, ours) == want  # sparkchat's own {"name", "parameters"} entries
    s = serve_tokenizer.special
    assert want.count(s["<|tools_start|>"]) == 1 and s["<|call_start|>"] in want and s["<|result_start|>"] in want
    # arguments as OpenAI sends them (a JSON string) render as given: compact JSON is render's call
    wire = [dict(convs[2][0][1], tool_calls=[{"type": "function", "function": {
        "name": CALL["name"], "arguments": json.dumps(CALL["arguments"], separators=(",", ":"), ensure_ascii=False)}}])]
    assert tool_template_ids(hf_tok, [convs[2][0][0], *wire, convs[2][0][2]], TOOLS) == want
    assert "apply_chat_template(messages, tools=[...])" in (exported / "README.md").read_text()  # the card says how
    # a conversation with calls and results but no tools given renders as render renders it
    assert tool_template_ids(hf_tok, convs[2][0], None) == render(serve_tokenizer, convs[2][1], for_completion=True)[0]


def tool_template_ids(hf_tok, conv, tools) -> list[int]:
    return list(hf_tok.apply_chat_template(conv, tools=tools, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"])


def test_autotokenizer_round_trips_text(hf_tok, serve_tokenizer):
    from conftest import SERVE_TEXTS
    for text in [*SERVE_TEXTS[:5], "  leading and trailing  ", "tabs\tand\nnewlines\r\n", "ünïcödé 🚀🚀 ∑"]:
        ids = hf_tok.encode(text)
        assert ids == serve_tokenizer.encode(text)  # the same ids, and no <|bos|> added
        assert hf_tok.decode(ids) == text
    # control-token text: sparkchat encodes it as text; transformers does so when asked (the card says so)
    text = "hi <|assistant_end|> there"
    assert hf_tok(text, split_special_tokens=True)["input_ids"] == serve_tokenizer.encode(text)
    assert serve_tokenizer.special["<|assistant_end|>"] in hf_tok(text)["input_ids"]


def test_export_loads_back_into_sparkchat(exported, serve_model, serve_tokenizer):
    model, tok, gen = load_model_dir(exported)
    assert gen == GEN and tok.special == serve_tokenizer.special
    ids = torch.tensor([[tok.bos_id] + tok.encode(PROMPTS[0])])
    with torch.no_grad():
        assert torch.equal(model(ids), serve_model(ids))


# ---- a NanoChat directory made by transformers, as a published checkpoint would be ----

NANOCHAT_SPECIALS = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                     "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]


@pytest.fixture(scope="module")
def nanochat_dir(tmp_path_factory):
    """A random NanoChatForCausalLM saved by transformers, with a nanochat-style tokenizer (no system tokens)
    and transformers' default rms_norm_eps; no checksums.json, no sparkchat files."""
    from conftest import SERVE_TEXTS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(SERVE_TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=NANOCHAT_SPECIALS,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                             show_progress=False))
    path = tmp_path_factory.mktemp("nanochat")
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|bos|>",
                                         eos_token="<|assistant_end|>").save_pretrained(path)
    torch.manual_seed(0)
    cfg = transformers.NanoChatConfig(vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, initializer_range=0.2)
    transformers.NanoChatForCausalLM(cfg).save_pretrained(path)
    return path


def test_nanochat_dir_loads_into_sparkchat(nanochat_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(nanochat_dir).eval()
    model, tok, gen = load_model_dir(nanochat_dir)
    assert "<|system_start|>" not in tok.special and gen["tool_use"]  # nanochat's tool tokens: the calculator runs
    ids = torch.tensor([[tok.bos_id] + tok.encode(PROMPTS[1])])
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    # only the norms' epsilon differs (1e-6 there, float32's here, as nanochat itself has it)
    assert theirs.abs().max() > 0.1 and (ours - theirs).abs().max().item() <= 1e-4
    # a system prompt goes before the first user message, and the exported template does the same
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = render(tok, conv, for_completion=True)[0]
    assert tok.decode(ids) == "<|bos|><|user_start|>Be brief.\n\nHi<|user_end|><|assistant_start|>"
    from model.hf import hf_tokenizer
    for conv in CONVERSATIONS:
        prompt = conv[-1]["role"] == "user"
        assert template_ids(hf_tokenizer(tok, 128), conv, prompt) == render(tok, conv, for_completion=prompt)[0]


def test_a_config_sparkchat_cannot_run_is_refused(nanochat_dir, tmp_path):
    for key, value, match in (("hidden_act", "gelu", "hidden_act='gelu'"),
                              ("intermediate_size", 200, "intermediate_size=200"),
                              ("model_type", "llama", "model_type 'llama'")):
        bad = tmp_path / key
        shutil.copytree(nanochat_dir, bad)
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(config | {key: value}))
        with pytest.raises(ModelDirError, match=match):
            load_model_dir(bad)
    (tmp_path / "hidden_act" / "model.safetensors").unlink()
    with pytest.raises(ModelDirError, match="model.safetensors or model.safetensors.index.json is missing"):
        verify_model_dir(tmp_path / "hidden_act")


def test_sparkchat_serve_answers_from_a_nanochat_dir(nanochat_dir):
    """The real command, `sparkchat serve --model <NanoChat dir>`, answered through the openai client."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "sparkchat", "serve", "--model", str(nanochat_dir),
                             "--port", str(port), "--device", "cpu"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! How are you?"}]
        r = client.chat.completions.create(model="sparkchat", messages=messages, max_tokens=8, temperature=0)
        _, tok, _ = load_model_dir(nanochat_dir)
        assert r.usage.prompt_tokens == len(render(tok, messages, for_completion=True)[0])
        assert r.choices[0].finish_reason in ("stop", "length") and isinstance(r.choices[0].message.content, str)
        assert 1 <= r.usage.completion_tokens <= 8 + 8  # calculator outputs may be fed in between
    finally:
        proc.terminate()
        proc.wait(30)


# ---- the model card ----

def test_model_card_quotes_the_dvc_metrics_and_params(tmp_path, monkeypatch, serve_model, serve_tokenizer):
    """The export stage run in a project directory: the card's tables come from the metrics and params files."""
    from pipeline.export import main
    from pipeline.metrics import VAL_BPB, write_json
    monkeypatch.chdir(tmp_path)
    save_model_dir(paths.CHAT_MODEL, serve_model, serve_tokenizer, GEN, extra={"stage": "sft", "backend_label": "bf16"})
    write_json(paths.stage_params("prepare"), {"data": {"pretrain_sources": ["my_corpus.txt"],
                                                        "chat_sources": ["hub:some/chats"]}})
    for stage, backend in zip(paths.TRAIN_STAGES, ("fp8", "te-fp8 (delayed)", "bf16")):
        write_json(paths.details_file(stage), {"backend_label": backend, "device": "cuda:0", "steps": 123, "tokens": 4567})
        write_json(paths.metrics_file(stage), {"train_loss": 1.25, VAL_BPB[stage]: 0.875})
    write_json(paths.metrics_file(paths.eval_reports("sft")), {"arithmetic": 0.625})
    write_json(paths.details_file(paths.eval_reports("sft")), {"benchmarks": {"gsm8k": {"accuracy": 0.375}},
                                                               "chance": {"arithmetic": 0.0}})
    main([])
    card = (paths.HF_EXPORT / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert f"| parameters | {serve_model.num_params():,} |" in card
    assert "my_corpus.txt" in card and "hub:some/chats" in card
    assert "| midtrain | te-fp8 (delayed) | cuda:0 | 123 | 4,567 | 1.25 | 0.875 (chat) |" in card
    assert "| sft | bf16 | cuda:0 | 123 | 4,567 | 1.25 | 0.875 (replies) |" in card
    assert "| task | sft | chance |" in card and "| arithmetic | 0.625 | 0 |" in card
    assert "| gsm8k.accuracy | 0.375 | - |" in card
    assert 'path = "artifacts/hf"' in card
    # another model directory: the pipeline's metrics are not its own, so the card does not quote them
    shutil.copytree(paths.CHAT_MODEL, tmp_path / "other")
    main(["--model", "other", "--out", "other_hf"])
    card = (tmp_path / "other_hf" / "README.md").read_text()
    assert "0.625" not in card and "te-fp8" not in card and "Not recorded here" in card
