"""Chat completions logic: an OpenAI request -> engine generations -> an OpenAI response or SSE stream.

Routes (api.py) only parse and dispatch; here the request is checked beyond its schema, rendered by the
training chat renderer, and its `n` choices run as `n` engine requests in the same batch. What both
endpoints share (checks, sampling settings, running and merging streams) lives here too;
completions.py holds the rest of /v1/completions.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from json.encoder import encode_basestring  # json.dumps of a str with ensure_ascii=False, without its wrapper
from typing import AsyncIterator, Callable

from fastapi import Request
from pydantic import BaseModel

from model.chat import ChatFormatError, content_text, display_words
from model.requests import EngineStopped, PromptTooLong, QueueFull, SamplingParams, Token
from model.tokenizer import SparkTokenizer

from .engine_link import EngineStalled
from .errors import APIError, engine_stalled, engine_stopped, error_body
from .runtime import Runtime, TextStream, merged
from .sse import Last
from . import tool_calls
from .structured import format_grammar
from .schemas import (AssistantMessage, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage,
                      Choice, ChoiceLogprobs, ChunkChoice, Delta, TokenLogprob, ToolCallDelta, TopLogprob, Usage,
                      _Sampling)

SEED_STRIDE = 1  # choice i of a seeded request uses seed + i
# seconds a client refused for a full queue waits (the 429's Retry-After; the openai package honours it):
# a queued request takes a row when one frees, and rows free as replies end, every second or so at the
# default reply lengths
RETRY_AFTER_S = 1


def _max_tokens(req: ChatCompletionRequest) -> int | None:
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise APIError(400, "Set max_completion_tokens or max_tokens, not both", "max_tokens")
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def check_supported(req, runtime: Runtime) -> None:
    """Every endpoint's first checks: no parameter this server would have to ignore, and its model."""
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"'{bad[0]}' is not supported by this server", bad[0], "unsupported_parameter")
    if req.model != runtime.model_id:
        raise APIError(404, f"The model '{req.model}' does not exist (this server serves "
                            f"'{runtime.model_id}')", "model", "model_not_found")


def check_common(req: _Sampling, runtime: Runtime) -> None:
    """The checks both completions endpoints make beyond their schemas."""
    check_supported(req, runtime)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    outside = [i for i in req.bias() or {} if i >= runtime.vocab_size]
    if outside:
        raise APIError(400, f"Invalid value for 'logit_bias': token {outside[0]} is outside the vocabulary "
                            f"(0..{runtime.vocab_size - 1})", "logit_bias", "invalid_value")


def check(req: ChatCompletionRequest, runtime: Runtime) -> list[int]:
    """Everything a schema cannot say; returns the prompt ids."""
    check_common(req, runtime)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs", "invalid_value")
    format_grammar(req.response_format, runtime, "response_format")  # a bad schema: a 400 before any work
    fields = tool_calls.ToolFields.of_chat(req)
    tool_calls.check(fields, runtime)
    called: set[str] = set()  # the ids of the calls so far (a tool message answers one)
    messages = [tool_calls.message_parts(i, m, called) or _message(i, m) for i, m in enumerate(req.messages)]
    try:
        check_length(runtime, runtime.fewest_tokens(content_text(m["content"]) for m in messages), "messages",
                     "at least ")
        ids = runtime.render(messages, tool_calls.functions(fields))
    except ChatFormatError as e:
        raise APIError(400, str(e), "messages") from None
    check_length(runtime, len(ids), "messages")
    return ids


def check_length(runtime: Runtime, tokens: int, param: str, floor: str = "") -> None:
    """A prompt of `tokens` (`floor`: "at least " when that is a bound found without tokenizing) must
    leave room for a reply."""
    if tokens >= runtime.context_len:
        what = {"messages": "your messages resulted in", "input": "your input resulted in"}[param]
        raise APIError(400, f"This model's maximum context length is {runtime.context_len} tokens; {what} "
                            f"{floor}{tokens} tokens, leaving no room for a reply. Please shorten the {param}.",
                       param, "context_length_exceeded")


def _message(i: int, m: ChatMessage) -> dict:
    """A request message for the renderer: an assistant turn sent back with its `sparkchat_parts`
    renders from them (tool calls, results and answer line as the model wrote them)."""
    if m.role in ("system", "developer") and i:  # OpenAI's models take these anywhere; this one as trained
        raise APIError(400, f"messages[{i}]: a {m.role} message may only come first (this model takes one "
                            f"system prompt, before the conversation)", f"messages[{i}].role")
    if m.sparkchat_parts is None:  # a developer message is the system prompt (OpenAI's newer name for it)
        return {"role": "system" if m.role == "developer" else m.role, "content": m.model_dump()["content"]}
    if m.role != "assistant":
        raise APIError(400, f"messages[{i}]: only assistant messages carry sparkchat_parts",
                       f"messages[{i}].sparkchat_parts")
    parts = [p.model_dump() for p in m.sparkchat_parts]
    if content_text(m.model_dump()["content"]).strip() != display_words(parts).strip():
        raise APIError(400, f"messages[{i}]: content is not the words of its sparkchat_parts (send the "
                            f"message back unchanged, or without sparkchat_parts)", f"messages[{i}].content")
    return {"role": "assistant", "content": parts}


def sampling(req: _Sampling, runtime: Runtime, choice: int, max_tokens: int | None, **extras) -> SamplingParams:
    """Choice `choice`'s engine settings: the request's, generation.json's defaults for the rest."""
    try:
        return runtime.sampling(req.temperature, req.top_k, req.top_p, max_tokens,
                                None if req.seed is None else req.seed + SEED_STRIDE * choice,
                                presence_penalty=req.presence_penalty or 0.0,
                                frequency_penalty=req.frequency_penalty or 0.0,
                                logit_bias=extras.pop("logit_bias", req.bias()), **extras)
    except ValueError as e:  # a value out of range
        raise APIError(400, str(e)) from None


async def open_streams(runtime: Runtime, jobs: list[tuple[list[int], SamplingParams]], stop: list[str],
                       prompt_param: str = "messages", chat: bool = True) -> list[TextStream]:
    """Submit every (prompt ids, settings) job, all or none: engine refusals become HTTP errors."""
    if len(jobs) > runtime.max_queue:  # (the engine would refuse it as a full queue, however idle)
        raise APIError(400, f"This request asks for {len(jobs)} generations (its prompts times n); this server "
                            f"queues at most {runtime.max_queue} at once", "n")
    try:
        return await runtime.open_streams(jobs, stop, chat)
    except QueueFull as e:
        raise APIError(429, f"The server is busy: {e}. Retry shortly.", None, "queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineStalled as e:
        raise engine_stalled(str(e)) from None
    except EngineStopped as e:
        raise engine_stopped(str(e)) from None
    except PromptTooLong as e:
        raise APIError(400, str(e), prompt_param, "context_length_exceeded") from None
    except ValueError as e:  # a value out of range
        raise APIError(400, str(e)) from None


async def _chat_streams(req: ChatCompletionRequest, runtime: Runtime, prompt: list[int]) -> list[TextStream]:
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    fields = tool_calls.ToolFields.of_chat(req)
    grammar = tool_calls.grammar(fields, runtime) or format_grammar(req.response_format, runtime, "response_format")
    bias = tool_calls.bias(fields, runtime)
    jobs = [(prompt, sampling(req, runtime, i, _max_tokens(req), logprobs=logprobs, grammar=grammar, logit_bias=bias))
            for i in range(req.n)]
    return await open_streams(runtime, jobs, req.stop_list())


def token_str(b: bytes) -> str:
    """A token's bytes as the API shows them: the text, or, when they are not whole UTF-8 characters,
    OpenAI's "bytes:\\xe4\\xbd" form (so distinct tokens never share a name)."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def token_logprobs(tok: SparkTokenizer, tokens: list[Token]) -> ChoiceLogprobs:
    """Chat's logprobs shape: each token as text, and its bytes."""
    def entry(i: int, logprob: float) -> dict:
        b = tok.token_bytes(i)
        return {"token": token_str(b), "logprob": logprob, "bytes": list(b)}

    return ChoiceLogprobs(content=[TokenLogprob(**entry(t.id, t.logprob),
                                                top_logprobs=[TopLogprob(**entry(j, lp)) for j, lp in t.top])
                                   for t in tokens])


def finish_reason(s: TextStream, calls: list | None = None) -> str:
    return "length" if s.finish_reason == "length" else "tool_calls" if calls else "stop"


FAILED = "The model failed while generating (the server's log says why)"
# what a stream sends when its generation failed, then [DONE] (as vLLM does; the openai package raises it)
FAILED_EVENT = f"data: {json.dumps(error_body(500, FAILED, code='engine_error'))}\n\n"


def check_failed(streams: list[TextStream]) -> None:
    """A whole response whose generation failed (the engine's error, or the engine process gone) is a 500."""
    if any(s.finish_reason == "error" for s in streams):
        raise APIError(500, FAILED, code="engine_error")


def _usage(prompt: list[int], streams: list[TextStream]) -> Usage:
    done = sum(s.completion_tokens for s in streams)
    return Usage(prompt_tokens=len(prompt), completion_tokens=done, total_tokens=len(prompt) + done)


async def _watch_disconnect(raw: Request, streams: list[TextStream]) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            for s in streams:
                s.cancel()
            return


async def collect(streams: list[TextStream], raw: Request) -> list[str]:
    """Every stream's whole text; a client that goes away cancels them all."""
    watcher = asyncio.create_task(_watch_disconnect(raw, streams))
    texts = [[] for _ in streams]
    try:
        async with contextlib.aclosing(merged(streams)) as pieces:
            async for i, piece in pieces:
                if piece:
                    texts[i].append(piece)
        return ["".join(t) for t in texts]
    finally:
        watcher.cancel()


def sse(message: BaseModel, exclude: set[str] | None = None) -> str:
    """One server-sent event, by pydantic's own JSON writer (the rarer events: see TextChunks)."""
    return f"data: {message.model_dump_json(exclude=exclude)}\n\n"


class TextChunks:
    """The per-token event, `data: {...}` of a chunk whose only news is a choice's text, without a
    pydantic object per chunk: the chunk's JSON is written once (`template`, built with a marker as the
    text) and each event is its two halves around the text as a JSON string. The same JSON as sse() writes
    for that chunk (tests parse both with the openai package)."""
    MARK = "\x00sparkchat-text\x00"

    def __init__(self, template, exclude: set[str] | None = None):
        """template(index, text) -> the pydantic chunk for choice `index` with `text`; `exclude` as sse's."""
        self.template, self.exclude, self.halves = template, exclude, {}

    def __call__(self, index: int, text: str) -> str:
        halves = self.halves.get(index)
        if halves is None:
            whole = sse(self.template(index, self.MARK), self.exclude)
            halves = self.halves[index] = whole.split(json.dumps(self.MARK), 1)
        return halves[0] + encode_basestring(text) + halves[1]


async def complete(req: ChatCompletionRequest, runtime: Runtime, prompt: list[int], raw: Request) -> ChatCompletion:
    streams = await _chat_streams(req, runtime, prompt)
    texts = await collect(streams, raw)
    check_failed(streams)
    choices = []
    for i, (t, s) in enumerate(zip(texts, streams)):
        calls = tool_calls.calls(s.parts) or None
        choices.append(Choice(index=i, message=AssistantMessage(content=t if t or not calls else None, tool_calls=calls,
                                                                sparkchat_parts=s.parts),
                              finish_reason=finish_reason(s, calls),
                              logprobs=token_logprobs(runtime.tokenizer, s.tokens) if req.logprobs else None))
    return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=runtime.model_id,
                          choices=choices, usage=_usage(prompt, streams))


async def stream(req: ChatCompletionRequest, runtime: Runtime,
                 prompt: list[int]) -> tuple[AsyncIterator[str], Callable[[], None]]:
    """Open the streams now (so errors become HTTP errors), then return the SSE frame iterator and what
    cancels the streams (serve.sse.EventStream's on_close)."""
    streams = await _chat_streams(req, runtime, prompt)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices, usage=None) -> str:
        c = ChatCompletionChunk(id=cid, created=created, model=runtime.model_id, choices=choices, usage=usage)
        return sse(c, exclude={"usage"} if not include_usage else None)

    text = TextChunks(lambda i, t: ChatCompletionChunk(id=cid, created=created, model=runtime.model_id, choices=[
        ChunkChoice(index=i, delta=Delta(content=t))]), exclude={"usage"} if not include_usage else None)

    def logprobs(s: TextStream) -> ChoiceLogprobs | None:
        tokens = s.take_tokens() if req.logprobs else []
        return token_logprobs(runtime.tokenizer, tokens) if tokens else None

    async def frames():
        # what goes out with the next event (each event is a write): the role chunks with the first
        # words, a choice's last chunk with another's
        held = "".join(chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
                       for i in range(len(streams)))
        async with contextlib.aclosing(merged(streams)) as pieces:
            async for i, piece in pieces:
                s = streams[i]
                if s.finish_reason == "error":
                    held += FAILED_EVENT
                    break
                if piece is None:  # tokens whose text was held back (a possible stop string) come last
                    calls = tool_calls.calls(s.parts)
                    if calls:  # each call whole, in one delta of OpenAI's shape
                        held += chunk([ChunkChoice(index=i, delta=Delta(tool_calls=[
                            ToolCallDelta(index=k, **c.model_dump()) for k, c in enumerate(calls)]))])
                    held += chunk([ChunkChoice(index=i, delta=Delta(sparkchat_parts=s.parts),
                                               finish_reason=finish_reason(s, calls), logprobs=logprobs(s))])
                    continue
                lp = logprobs(s)
                if lp:
                    event = chunk([ChunkChoice(index=i, delta=Delta(content=piece), logprobs=lp)])
                elif piece:  # "" marks a tool use: its parts come with the last chunk
                    event = text(i, piece)
                else:
                    continue
                yield held + event
                held = ""
        if include_usage and not any(s.finish_reason == "error" for s in streams):
            held += chunk([], _usage(prompt, streams))
        yield Last(held + "data: [DONE]\n\n")

    return frames(), lambda: cancel_all(streams)


def cancel_all(streams: list[TextStream]) -> None:
    for s in streams:
        s.cancel()
