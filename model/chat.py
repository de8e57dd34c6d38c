"""Conversation rendering: OpenAI-style `messages` -> token ids + loss mask.

One renderer for training and inference, so the server prompts the model exactly as it was trained:

    <|bos|> [<|system_start|> ... <|system_end|>]
    <|user_start|> ... <|user_end|> <|assistant_start|> ... <|assistant_end|> ...

Assistant content is a string or a list of parts: {"type": "text"}, {"type": "python"} (a calculator
call, rendered between python_start/end), {"type": "python_output"} (the tool's answer, rendered
between output_start/end) and {"type": "call"} (a call of a client's function, between call_start/end).
A `tool` message is a function's result (between result_start/end, after the turn that called it), and
`tools` (function definitions) render after the system prompt: model/tools.py shows the whole form. The
mask is 1 on what the model must learn to produce: assistant text, tool
calls and the closing <|assistant_end|>; 0 on prompts and tool outputs (the engine supplies those).

A generated reply has the same structure, and this file is also its one home (`ReplyReader`): the
reply's ids become its parts, which re-render to the very same ids (history stays as trained), and its
display, which every front end uses: the assistant's *words* (the text parts, the training data's final
answer line `#### N` left out) and, apart from them, its *tool uses* (a calculator call and its result)
and its *function calls* (a call of a client's function; its result comes back in a later `tool` message).

A tokenizer without the system tokens (nanochat's, in a published NanoChat checkpoint) gets the system
prompt in front of the first user message, separated by a blank line, as nanochat renders it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .tokenizer import SparkTokenizer, StreamDecoder
from .tools import has_tools, parse_call, tools_text

ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "python", "python_output", "call")
# a reply ends at either (model/chat_engine.py stops the engine there; the engine does not emit them)
STOP_TOKENS = ("<|assistant_end|>", "<|bos|>")

# The final-answer line of GSM8K-style training replies ("... = 84.\n#### 84"): a marker for graders,
# not words for a reader, so the display leaves it out when it is the reply's last line.
ANSWER_MARKER = "\n#### "


class ChatFormatError(ValueError):
    pass


def content_parts(content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in PART_TYPES:
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


def render(tok: SparkTokenizer, messages: list[dict], for_completion: bool = False, tools: list[dict] | None = None):
    """Returns (ids, mask). With for_completion, the conversation must end with a user or tool message and
    the ids end with <|assistant_start|>, ready for generation. `tools`: function definitions ({"name",
    "parameters"}), shown to the model after the system prompt."""
    validate(messages)
    s = tok.special
    uses_tools = tools or any(m["role"] == "tool" for m in messages) or any(
        p["type"] == "call" for m in messages if m["role"] == "assistant" for p in content_parts(m["content"]))
    if uses_tools and not has_tools(tok):
        raise ChatFormatError("this model was not trained for function calling (its tokenizer has no tool tokens)")
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

    def add_tools():
        add([s["<|tools_start|>"]] + tok.encode(tools_text(tools)) + [s["<|tools_end|>"]], 0)

    if tools and messages[0]["role"] != "system":
        add_tools()
    for m in messages:
        role, parts = m["role"], content_parts(m["content"])
        if role == "tool":
            add([s["<|result_start|>"]] + tok.encode(content_text(parts)) + [s["<|result_end|>"]], 0)
        elif role in ("system", "user"):
            text = "".join(p["text"] for p in parts if p["type"] == "text")
            add([s[f"<|{role}_start|>"]], 0)
            add(tok.encode(text), 0)
            add([s[f"<|{role}_end|>"]], 0)
            if role == "system" and tools:
                add_tools()
        else:
            add([s["<|assistant_start|>"]], 0)
            for p in parts:
                if p["type"] == "text":
                    add(tok.encode(p["text"]), 1)
                elif p["type"] == "python":
                    add([s["<|python_start|>"]] + tok.encode(p["text"]) + [s["<|python_end|>"]], 1)
                elif p["type"] == "call":
                    add([s["<|call_start|>"]] + tok.encode(p["text"]) + [s["<|call_end|>"]], 1)
                else:
                    add([s["<|output_start|>"]] + tok.encode(p["text"]) + [s["<|output_end|>"]], 0)
            add([s["<|assistant_end|>"]], 1)
    if for_completion:
        if messages[-1]["role"] not in ("user", "tool"):
            raise ChatFormatError("the last message must come from the user (or be a tool's result)")
        add([s["<|assistant_start|>"]], 0)
    return ids, mask


def history_budget(context: int, max_tokens: int) -> int:
    """The prompt ids a conversation may take: the reply keeps at most half the context, at most what it may use."""
    return context - min(max_tokens, context // 2)


def fit_history(tok, messages: list[dict], budget: int, tools: list[dict] | None = None
                ) -> tuple[list[int], list[dict], int]:
    """The prompt ids of `messages`, dropping the oldest exchanges (never the system prompt, never the
    last message) until they fit `budget` ids: (ids, the messages kept, how many were dropped). A cut
    in the middle of the ids would lose <|bos|> and the system prompt and start mid-turn."""
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(head):]
    dropped = 0
    while True:
        ids, _ = render(tok, head + turns, for_completion=True, tools=tools)
        if len(ids) <= budget or len(turns) <= 1:
            return ids, head + turns, dropped
        cut = 2 if len(turns) > 2 and turns[1]["role"] == "assistant" else 1  # a user turn and its reply
        turns, dropped = turns[cut:], dropped + cut


# ---- a generated reply: ids -> parts (as trained) and display (words + tool uses) ----

@dataclass
class ToolUse:
    """One calculator use as a reader sees it."""
    call: str
    output: str | None  # None: no result came back (the tool failed, or the reply ended first)

    def __str__(self) -> str:  # how every front end shows it: "37 + 58 → 95"
        return f"{self.call} → {'(no result)' if self.output is None else self.output}"


@dataclass
class FunctionCall:
    """One call of a client's function as a reader sees it: the text the model wrote, and the result once the
    client feeds one back (a front end fills it in; a reply itself holds no result)."""
    text: str
    result: str | None = None

    def __str__(self) -> str:  # how every front end shows it: 'get_weather {"city": "Paris"} → 21'
        call = parse_call(self.text)
        shown = self.text if call is None else f"{call[0]} {json.dumps(call[1], ensure_ascii=False)}"
        return shown if self.result is None else f"{shown} → {self.result}"


class _Words:
    """Text deltas -> the same deltas with a final answer line left out. A tail that could still become
    `ANSWER_MARKER ...` as the reply's last line is held back until a later newline (it was not the
    last line: shown) or the end of the reply (dropped)."""

    def __init__(self):
        self.held = ""

    def push(self, text: str) -> str:
        buf = self.held + text
        cut = buf.rfind("\n")
        tail = buf[cut:] if cut >= 0 else ""
        if tail and (ANSWER_MARKER.startswith(tail) or tail.startswith(ANSWER_MARKER)):
            self.held = tail
            return buf[:cut]
        self.held = ""
        return buf

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if held.startswith(ANSWER_MARKER) else held


class ReplyReader:
    """Reads a reply as it is generated (the ids after <|assistant_start|>, without the stop id).

    `push(id)` and, at the end, `finish()` return what to show now, in order: `str` pieces of the
    assistant's words (never splitting a UTF-8 character), `ToolUse`s, each once its result is in, and
    `FunctionCall`s, each once its call is complete (also in `function_calls`).
    `parts` is the reply as content parts ({"type": "text" | "python" | "python_output", "text"}), the
    form `render` takes back: rendered after the same prompt they give the ids read, as long as the model
    wrote text as the tokenizer splits it (as it was trained to); control ids other than the tool
    delimiters are dropped. `words` is everything shown as words so far.
    """

    def __init__(self, tok: SparkTokenizer):
        self.tok = tok
        s = tok.special
        self._opens = {s["<|python_start|>"]: "python", s["<|output_start|>"]: "python_output"}
        self._closes = {s["<|python_end|>"], s["<|output_end|>"]}
        if has_tools(tok):
            self._opens[s["<|call_start|>"]] = "call"
            self._closes.add(s["<|call_end|>"])
        self._special = set(s.values())
        self.parts: list[dict] = []
        self.tool_uses: list[ToolUse] = []
        self.function_calls: list[FunctionCall] = []
        self.words = ""
        self._kind, self._ids = "text", []  # the part being read
        self._text: list[str] = []  # a text part's words as decoded (decode(ids) of its ids, in pieces)
        self._call: str | None = None  # a finished call whose result has not come yet
        self._decoder, self._filter = StreamDecoder(tok), _Words()
        self.done = False

    def push(self, i: int) -> list:
        out = []
        if i in self._opens or i in self._closes:
            self._close(out)
            self._kind = self._opens.get(i, "text")
            if self._kind == "python":
                self._settle(out)
        elif i not in self._special:
            self._plain(out, [i])
        return out

    def read(self, ids: list[int]) -> list:
        """push() of each id in turn, the words of plain ids in a row as one piece (the same words: a
        front end reads a stream's new ids a few at a time, and this costs less a token)."""
        out, run = [], []
        for i in ids:
            if i in self._special:
                if run:
                    self._plain(out, run)
                    run = []
                out += self.push(i)
            else:
                run.append(i)
        if run:
            self._plain(out, run)
        return out

    def _plain(self, out: list, ids: list[int]) -> None:
        """Ids that are not control ids, in a row: their words, shown unless in a tool part (the answer-line
        filter reads joined text as it reads the pieces: what it holds back depends only on the text after
        the last newline)."""
        if self._kind == "text":
            self._settle(out)
            text = self._decoder.read(ids)
            self._text.append(text)
            self._show(out, self._filter.push(text))
        self._ids += ids

    def finish(self) -> list:
        self.done = True
        out = []
        self._close(out)
        self._settle(out)
        self._show(out, self._filter.flush())
        return out

    def _show(self, out: list, text: str) -> None:
        if text:
            self.words += text
            out.append(text)

    def _close(self, out: list) -> None:
        """The part being read is complete: add it to `parts` (and settle a call's result)."""
        kind, ids = self._kind, self._ids
        self._kind, self._ids = "text", []
        if kind == "text":
            rest = self._decoder.flush()
            self._show(out, self._filter.push(rest))
            if ids:  # what decode(ids) gives (StreamDecoder's promise), without decoding the reply again
                self.parts.append({"type": "text", "text": "".join(self._text) + rest})
            self._text = []
            return
        text = self.tok.decode(ids)
        self.parts.append({"type": kind, "text": text})
        if kind == "python":
            self._call = text
        elif kind == "python_output" and self._call is not None:
            self._use(out, ToolUse(self._call, text))
        elif kind == "call":
            self.function_calls.append(FunctionCall(text))
            out.append(self.function_calls[-1])

    def _settle(self, out: list) -> None:
        """A call followed by anything but its result got none."""
        if self._call is not None:
            self._use(out, ToolUse(self._call, None))

    def _use(self, out: list, use: ToolUse) -> None:
        self.tool_uses.append(use)
        out.append(use)
        self._call = None


def read_reply(tok: SparkTokenizer, ids: list[int]) -> ReplyReader:
    """A whole reply read at once: `.parts`, `.words`, `.tool_uses`, `.function_calls`."""
    reader = ReplyReader(tok)
    for i in ids:
        reader.push(i)
    reader.finish()
    return reader


def display_words(parts: list[dict]) -> str:
    """The words a reply with these content parts shows (what ReplyReader shows as it streams)."""
    f = _Words()
    return "".join(f.push(p["text"]) for p in content_parts(parts) if p["type"] == "text") + f.flush()


def cut_parts(parts: list[dict], n: int) -> list[dict]:
    """The parts of a reply cut after its first `n` characters of words (where a stop string cut it)."""
    out = []
    for p in parts:
        if p["type"] == "text":
            if len(p["text"]) >= n:
                return out + ([{"type": "text", "text": p["text"][:n]}] if n else [])
            n -= len(p["text"])
        out.append(p)
    return out
