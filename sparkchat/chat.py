"""`sparkchat chat`: talk to a model directory in the terminal, one reply streamed at a time.

A front end over `model/` like the server, wired the same way (model.chat_engine), and lighter: no HTTP.
The parser is built without torch; the model code loads after the flags are read. `-p TEXT` answers one
message and exits (as `ollama run MODEL TEXT`); lines piped in are a conversation, one message a line.

A reply shows as the server shows it (model.chat.ReplyReader): the assistant's words, and each
calculator use and each function call on a dimmed line of its own; the history keeps the reply's parts, so
the next turn's prompt holds the calculator call and result exactly as the model wrote them. `--tools FILE`
offers functions (OpenAI `tools` entries, checked as the server checks them); after a reply that calls one,
the next line read is the call's result (a `tool` message, prompted `result> `), and the model goes on.
"""
from __future__ import annotations

import argparse
import json
import queue
import sys

from sparkchat import paths, start

DIM, PLAIN = "\033[2m", "\033[0m"  # only on a terminal: piped output stays plain text
# the reply is promised a quarter of the context (or its max_tokens, if fewer); the history may take the
# rest, and the reply any room the history leaves (the engine caps it there)
REPLY_SHARE = 4


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sparkchat chat", description="Chat with a sparkchat model in the terminal. "
                                 "Type /clear to start over, Ctrl-D to quit.")
    ap.add_argument("--model", default=str(paths.CHAT_MODEL),
                    help="model directory, sparkchat's or a Hugging Face NanoChat one (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature, 0 for greedy (default: the model's generation.json)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="longest reply in tokens (default: the model's generation.json)")
    ap.add_argument("--system", default=None, help="system prompt (default: none)")
    ap.add_argument("--tools", default=None, metavar="FILE",
                    help="functions the model may call: a JSON file of OpenAI `tools` entries; a call's result is "
                         "the next line you type (default: none)")
    ap.add_argument("-p", "--prompt", default=None, metavar="TEXT",
                    help="answer this one message, print the reply and exit (default: a conversation)")
    return ap


def undecodable(line: str) -> str | None:
    """What is wrong with a line read from stdin that was not UTF-8 (None when it was). stdin reads with
    surrogateescape (main), so each byte that is not UTF-8 arrives as a lone surrogate, U+DC80..U+DCFF."""
    for i, c in enumerate(line):
        if "\udc80" <= c <= "\udcff":
            return f"byte 0x{ord(c) - 0xdc00:02x} at character {i + 1} is not UTF-8"
        if "\ud800" <= c <= "\udfff":
            return f"character {i + 1} is a lone surrogate"
    return None


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    missing = start.missing_model(args.model)
    if missing:  # before torch loads: said at once
        ap.error(missing)
    for flag, text in (("--system", args.system), ("--prompt", args.prompt)):
        if text and undecodable(text):  # argv, like stdin, carries bytes that are not UTF-8 so
            ap.error(f"{flag}: {undecodable(text)}")
    if args.prompt is not None and not args.prompt.strip():
        ap.error("--prompt: the message is empty")
    tools = read_tools(ap, args.tools) if args.tools else None
    if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 is said and skipped, not a traceback
        sys.stdin.reconfigure(errors="surrogateescape")

    from model.chat_engine import chat_engine
    from model.requests import sampling_params
    from model.device import resolve_device
    from model.model_dir import ModelDirError, load_model_dir

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        ap.error(f"--device {e}; --device cpu runs anywhere")
    try:
        model, tok, gen = load_model_dir(args.model, device=device)
        params = sampling_params(gen, temperature=args.temperature, max_tokens=args.max_tokens)
    except (ModelDirError, ValueError) as e:
        ap.error(str(e))
    engine = chat_engine(model, tok, gen, max_batch=1)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        try:
            answer(engine, tok, messages + [{"role": "user", "content": args.prompt.strip()}], params, sys.stdout,
                   tools)
        except Exception as e:  # a prompt the engine refuses, or a reply that failed
            sys.exit(f"sparkchat chat: {e}")
        finally:
            engine.shutdown()
        return
    print("sparkchat: type a message (Ctrl-D to quit, /clear to start over)", file=sys.stderr)
    try:
        while True:
            role = "tool" if calls_of(messages) else "user"  # after a call: its result
            try:
                text = input("result> " if role == "tool" else "> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                break
            if text == "/clear":
                messages = messages[:1] if args.system else []
                continue
            if not text:
                continue
            bad = undecodable(text)
            if bad:
                print(f"sparkchat chat: that line was not sent: {bad} (is the terminal set to UTF-8?); "
                      f"type it again", file=sys.stderr)
                continue
            messages.append({"role": role, "content": text})
            try:
                messages = answer(engine, tok, messages, params, sys.stdout, tools)
            except Exception as e:  # a full queue or a prompt the engine refuses: say so, keep chatting
                print(f"error: {e}", file=sys.stderr)
                messages.pop()
    finally:
        engine.shutdown()


def read_tools(ap: argparse.ArgumentParser, path: str) -> list[dict]:
    """--tools FILE as model.tools takes the definitions, checked as the server checks a request's `tools`."""
    from serve.tool_calls import parse_definitions
    try:
        with open(path, encoding="utf-8") as f:
            return parse_definitions(json.load(f), "--tools")
    except OSError as e:
        ap.error(f"--tools: cannot read {path} ({e.strerror})")
    except ValueError as e:  # not JSON, or not tools
        ap.error(str(e) if str(e).startswith("--tools") else f"--tools: {path} is not JSON ({e})")


def calls_of(messages: list[dict]) -> list[str]:
    """The function calls of the conversation's last message, when it is a reply that made some."""
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or isinstance(last["content"], str):
        return []
    return [p["text"] for p in last["content"] if p["type"] == "call"]


def answer(engine, tok, messages: list[dict], params, out, tools: list[dict] | None = None) -> list[dict]:
    """One exchange: prompts with `messages` (ending with the user's, or a call's result) and `tools`, streams
    the reply to `out` and returns the conversation that goes on: the messages kept (the oldest exchanges
    are dropped, with a note, when they outgrow the context) and the reply as its content parts."""
    from model.chat import fit_history, history_budget
    reserve = min(params.max_tokens, engine.max_len // REPLY_SHARE)
    ids, messages, dropped = fit_history(tok, messages, history_budget(engine.max_len, reserve), tools)
    if dropped:
        kept = ", the system prompt kept" if messages[0]["role"] == "system" else ""
        dim, plain = (DIM, PLAIN) if sys.stderr.isatty() else ("", "")
        print(f"{dim}(the conversation outgrew the model's context of {engine.max_len} tokens: "
              f"{dropped} earlier messages dropped{kept}){plain}", file=sys.stderr)
    return messages + [{"role": "assistant", "content": reply(engine, tok, ids, params, out)}]


def reply(engine, tok, ids: list[int], params, out) -> list[dict]:
    """Generate a reply to the prompt `ids`, streaming it to `out` (words as they come, each calculator
    use and function call on a dimmed line of its own); returns the reply's content parts for the history."""
    from model.chat import FunctionCall, ReplyReader, ToolUse
    from model.requests import Token
    events: queue.Queue = queue.Queue()
    engine.submit(ids, params, events.put)  # raises on a full queue or a prompt the engine refuses
    reader = ReplyReader(tok)
    dim, plain = (DIM, PLAIN) if out.isatty() else ("", "")
    at_line_start, shown = True, False

    def show(items) -> None:
        nonlocal at_line_start, shown
        for item in items:
            if isinstance(item, (ToolUse, FunctionCall)):
                kind = "calculator" if isinstance(item, ToolUse) else "call"
                item = f"{'' if at_line_start else chr(10)}{dim}  {kind}: {item}{plain}\n"
            out.write(item)
            at_line_start, shown = item.endswith("\n"), True
        out.flush()

    while isinstance(ev := events.get(), Token):
        show(reader.push(ev.id))
    show(reader.finish())
    if not at_line_start or not shown:
        out.write("\n")
    if ev.reason == "error":  # the caller says so (and leaves the exchange out of the history)
        raise RuntimeError(ev.error)
    return reader.parts


if __name__ == "__main__":
    main()
