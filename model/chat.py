"""Conversation rendering: OpenAI-style `messages` -> token ids + loss mask.

One renderer for training and inference, so the server prompts the model exactly as it was trained:

    <|bos|> [<|system_start|> ... <|system_end|>]
    <|user_start|> ... <|user_end|> <|assistant_start|> ... <|assistant_end|> ...

Assistant content is a string or a list of parts: {"type": "text"}, {"type": "python"} (a calculator
call, rendered between python_start/end) and {"type": "python_output"} (the tool's answer, rendered
between output_start/end). The mask is 1 on what the model must learn to produce: assistant text, tool
calls and the closing <|assistant_end|>; 0 on prompts and tool outputs (the engine supplies those).

A tokenizer without the system tokens (nanochat's, in a published NanoChat checkpoint) gets the system
prompt in front of the first user message, separated by a blank line, as nanochat renders it.
"""
from __future__ import annotations

from .tokenizer import SparkTokenizer

ROLES = ("system", "user", "assistant")
# a reply ends at either (model/chat_engine.py stops the engine there; the engine does not emit them)
STOP_TOKENS = ("<|assistant_end|>", "<|bos|>")

# How a reply's tool tokens read when it is shown as text (tokenizer.StreamDecoder): "... `12*7 = 84` ..."
TOOL_DISPLAY = {"<|python_start|>": "`", "<|python_end|>": " = ", "<|output_start|>": "", "<|output_end|>": "`"}


class ChatFormatError(ValueError):
    pass


def content_parts(content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("text", "python", "python_output"):
                raise ChatFormatError(f"unsupported content part: {p!r:.80}")
            if not isinstance(p.get("text"), str):
                raise ChatFormatError("content part needs a string 'text'")
            parts.append(p)
        return parts
    raise ChatFormatError(f"content must be a string or a list of parts, got {type(content).__name__}")


def content_text(content) -> str:
    """Plain text of a message (tool calls and outputs dropped)."""
    return "".join(p["text"] for p in content_parts(content) if p["type"] == "text")


def validate(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatFormatError(f"messages[{i}].role must be one of {ROLES}")
        if m["role"] == "system" and i != 0:
            raise ChatFormatError(f"messages[{i}]: a system message may only come first")


def render(tok: SparkTokenizer, messages: list[dict], for_completion: bool = False):
    """Returns (ids, mask). With for_completion, the conversation must end with a user message and
    the ids end with <|assistant_start|>, ready for generation."""
    validate(messages)
    s = tok.special
    if messages[0]["role"] == "system" and "<|system_start|>" not in s:
        if len(messages) < 2 or messages[1]["role"] != "user":
            raise ChatFormatError("this model has no system tokens: a system message must be followed by a user "
                                  "message")
        first = {"role": "user", "content": content_text(messages[0]["content"]) + "\n\n"
                 + content_text(messages[1]["content"])}
        messages = [first] + messages[2:]
    ids, mask = [tok.bos_id], [0]

    def add(tokens, m):
        ids.extend(tokens)
        mask.extend([m] * len(tokens))

    for m in messages:
        role, parts = m["role"], content_parts(m["content"])
        if role in ("system", "user"):
            text = "".join(p["text"] for p in parts if p["type"] == "text")
            add([s[f"<|{role}_start|>"]], 0)
            add(tok.encode(text), 0)
            add([s[f"<|{role}_end|>"]], 0)
        else:
            add([s["<|assistant_start|>"]], 0)
            for p in parts:
                if p["type"] == "text":
                    add(tok.encode(p["text"]), 1)
                elif p["type"] == "python":
                    add([s["<|python_start|>"]] + tok.encode(p["text"]) + [s["<|python_end|>"]], 1)
                else:
                    add([s["<|output_start|>"]] + tok.encode(p["text"]) + [s["<|output_end|>"]], 0)
            add([s["<|assistant_end|>"]], 1)
    if for_completion:
        if messages[-1]["role"] != "user":
            raise ChatFormatError("the last message must come from the user")
        add([s["<|assistant_start|>"]], 0)
    return ids, mask
