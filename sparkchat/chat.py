"""`sparkchat chat`: talk to a model directory in the terminal, one reply streamed at a time.

A front end over `model/` like the server, wired the same way (model.chat_engine), and lighter: no HTTP.
The parser is built without torch; the model code loads after the flags are read.
"""
from __future__ import annotations

import argparse
import queue
import sys

from sparkchat import paths


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
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)

    from model.chat import TOOL_DISPLAY
    from model.chat_engine import chat_engine, sampling_params
    from model.engine import Token
    from model.model_dir import ModelDirError, load_model_dir
    from model.tokenizer import StreamDecoder

    try:
        model, tok, gen = load_model_dir(args.model, device=args.device)
        params = sampling_params(gen, temperature=args.temperature, max_tokens=args.max_tokens)
    except (ModelDirError, ValueError) as e:
        ap.error(str(e))
    engine = chat_engine(model, tok, gen, max_batch=1)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("sparkchat: type a message (Ctrl-D to quit, /clear to start over)", file=sys.stderr)
    try:
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
            # leave the reply room: at most half the context, at most what it may use
            budget = engine.max_len - min(params.max_tokens, engine.max_len // 2)
            ids, messages, dropped = fit_history(tok, messages, budget)
            if dropped:
                print(f"\033[2m(the conversation outgrew the model's context of {engine.max_len} tokens: "
                      f"{dropped} earlier messages dropped{', the system prompt kept' if args.system else ''})"
                      f"\033[0m", file=sys.stderr)
            events: queue.Queue = queue.Queue()
            try:
                engine.submit(ids, params, events.put)
            except Exception as e:  # a full queue or a prompt the engine refuses: say so, keep chatting
                print(f"error: {e}", file=sys.stderr)
                messages.pop()
                continue
            decoder = StreamDecoder(tok, TOOL_DISPLAY)
            reply = ""
            while isinstance(ev := events.get(), Token):
                piece = decoder.push(ev.id)
                print(piece, end="", flush=True)
                reply += piece
            tail = decoder.flush()
            print(tail)
            if ev.reason == "error":
                print(f"error: {ev.error}", file=sys.stderr)
            messages.append({"role": "assistant", "content": reply + tail})
    finally:
        engine.shutdown()


def fit_history(tok, messages: list[dict], budget: int) -> tuple[list[int], list[dict], int]:
    """The prompt ids of `messages`, dropping the oldest exchanges (never the system prompt, never the
    last message) until they fit `budget` ids: (ids, the messages kept, how many were dropped). A cut
    in the middle of the ids would lose <|bos|> and the system prompt and start mid-turn."""
    from model.chat import render
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(head):]
    dropped = 0
    while True:
        ids, _ = render(tok, head + turns, for_completion=True)
        if len(ids) <= budget or len(turns) <= 1:
            return ids, head + turns, dropped
        cut = 2 if len(turns) > 2 and turns[1]["role"] == "assistant" else 1  # a user turn and its reply
        turns, dropped = turns[cut:], dropped + cut


if __name__ == "__main__":
    main()
