"""The `sparkchat` command: chat in the terminal, serve the model, probe the precision backends.

    sparkchat chat [--model DIR]      talk to a model directory in the terminal
    sparkchat serve [--model DIR]     OpenAI-compatible API + Gradio page (see serve/__main__.py)
    sparkchat probe                   which precision backends run here, and what they buy
"""
from __future__ import annotations

import argparse
import sys

from sparkchat import paths


def chat(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="sparkchat chat", description="Chat with a sparkchat model in the terminal.")
    ap.add_argument("--model", default=str(paths.CHAT_MODEL), help="model directory (default: %(default)s)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--system", default=None, help="system prompt")
    args = ap.parse_args(argv)

    from model.calculator import calculator_tool
    from model.chat import render
    from model.engine import Engine, EngineConfig, SamplingParams, Token
    from model.model_dir import load_model_dir
    import queue

    model, tok, gen = load_model_dir(args.model, device=args.device)
    s = tok.special
    engine = Engine(model, EngineConfig(max_batch=1, stop_ids=(s["<|assistant_end|>"], s["<|bos|>"]),
                                        tool_start=s["<|python_start|>"], tool_end=s["<|python_end|>"]),
                    tool=calculator_tool(tok)).start()
    params = SamplingParams(temperature=args.temperature if args.temperature is not None else gen["temperature"],
                            top_k=gen.get("top_k", 0), max_tokens=args.max_tokens or gen["max_tokens"])
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("sparkchat: type a message (Ctrl-D to quit, /clear to start over)", file=sys.stderr)
    while True:
        try:
            text = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            break
        if text == "/clear":
            messages = messages[:1] if args.system else []
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        ids, _ = render(tok, messages, for_completion=True)
        events: queue.Queue = queue.Queue()
        try:
            engine.submit(ids[-engine.max_len + 1:], params, events.put)
        except Exception as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        reply: list[int] = []
        shown = ""
        while True:
            ev = events.get()
            if not isinstance(ev, Token):
                break
            reply.append(ev.id)
            text_now = tok.decode([t for t in reply if t not in s.values()])
            if not text_now.endswith("\ufffd"):
                print(text_now[len(shown):], end="", flush=True)
                shown = text_now
        print()
        messages.append({"role": "assistant", "content": shown})
    engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    cmd, rest = argv[0], argv[1:]
    if cmd == "chat":
        chat(rest)
    elif cmd == "serve":
        from serve.__main__ import main as serve_main
        serve_main(rest)
    elif cmd == "probe":
        from pipeline.probe import main as probe_main
        probe_main(rest)
    else:
        raise SystemExit(f"sparkchat: unknown command '{cmd}' (chat, serve, probe)")


if __name__ == "__main__":
    main()
