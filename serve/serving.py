"""Chat completions logic: an OpenAI request -> engine generations -> an OpenAI response or SSE stream.

Routes (api.py) only parse and dispatch; here the request is checked beyond its schema, rendered by the
training chat renderer, and its `n` choices run as `n` engine requests in the same batch.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import Request

from model.chat import ChatFormatError, content_text, display_words
from model.engine import EngineStopped, PromptTooLong, QueueFull

from .errors import APIError
from .runtime import Runtime, TextStream
from .schemas import (AssistantMessage, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage,
                      Choice, ChunkChoice, Delta, Usage)

SEED_STRIDE = 1  # choice i of a seeded request uses seed + i


def _max_tokens(req: ChatCompletionRequest) -> int | None:
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise APIError(400, "Set max_completion_tokens or max_tokens, not both", "max_tokens")
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def check(req: ChatCompletionRequest, runtime: Runtime) -> list[int]:
    """Everything a schema cannot say; returns the prompt ids."""
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"'{bad[0]}' is not supported by this server", bad[0], "unsupported_parameter")
    if req.model != runtime.model_id:
        raise APIError(404, f"The model '{req.model}' does not exist (this server serves "
                            f"'{runtime.model_id}')", "model", "model_not_found")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    try:
        ids = runtime.render([_message(i, m) for i, m in enumerate(req.messages)])
    except ChatFormatError as e:
        raise APIError(400, str(e), "messages") from None
    if len(ids) >= runtime.context_len:
        raise APIError(400, f"This model's maximum context length is {runtime.context_len} tokens; your "
                            f"messages resulted in {len(ids)} tokens, leaving no room for a reply. Please "
                            f"shorten the messages.", "messages", "context_length_exceeded")
    return ids


def _message(i: int, m: ChatMessage) -> dict:
    """A request message for the renderer: an assistant turn sent back with its `sparkchat_parts`
    renders from them (tool calls, results and answer line as the model wrote them)."""
    if m.sparkchat_parts is None:
        return {"role": m.role, "content": m.model_dump()["content"]}
    if m.role != "assistant":
        raise APIError(400, f"messages[{i}]: only assistant messages carry sparkchat_parts",
                       f"messages[{i}].sparkchat_parts")
    parts = [p.model_dump() for p in m.sparkchat_parts]
    if content_text(m.model_dump()["content"]).strip() != display_words(parts).strip():
        raise APIError(400, f"messages[{i}]: content is not the words of its sparkchat_parts (send the "
                            f"message back unchanged, or without sparkchat_parts)", f"messages[{i}].content")
    return {"role": "assistant", "content": parts}


def open_streams(req: ChatCompletionRequest, runtime: Runtime, prompt: list[int]) -> list[TextStream]:
    streams: list[TextStream] = []
    try:
        for i in range(req.n):
            params = runtime.sampling(req.temperature, req.top_k, req.top_p, _max_tokens(req),
                                      None if req.seed is None else req.seed + SEED_STRIDE * i)
            streams.append(runtime.open_stream(prompt, params, req.stop_list()))
    except (QueueFull, EngineStopped) as e:
        for s in streams:
            s.cancel()
        status = 429 if isinstance(e, QueueFull) else 503
        raise APIError(status, f"The server is busy: {e}. Retry shortly.", None,
                       "queue_full" if status == 429 else "engine_stopped") from None
    except PromptTooLong as e:
        for s in streams:
            s.cancel()
        raise APIError(400, str(e), "messages", "context_length_exceeded") from None
    except ValueError as e:  # a sampling value out of range
        for s in streams:
            s.cancel()
        raise APIError(400, str(e)) from None
    return streams


def _finish_reason(s: TextStream) -> str:
    return "length" if s.finish_reason == "length" else "stop"


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


async def complete(req: ChatCompletionRequest, runtime: Runtime, prompt: list[int], raw: Request) -> ChatCompletion:
    streams = open_streams(req, runtime, prompt)
    watcher = asyncio.create_task(_watch_disconnect(raw, streams))

    async def collect(s: TextStream) -> str:
        return "".join([piece async for piece in s])

    try:
        texts = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        watcher.cancel()
        for s in streams:
            s.cancel()
    choices = [Choice(index=i, message=AssistantMessage(content=t, sparkchat_parts=s.parts),
                      finish_reason=_finish_reason(s)) for i, (t, s) in enumerate(zip(texts, streams))]
    return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=runtime.model_id,
                          choices=choices, usage=_usage(prompt, streams))


def stream(req: ChatCompletionRequest, runtime: Runtime, prompt: list[int]) -> AsyncIterator[str]:
    """Open the streams now (so errors become HTTP errors), then return the SSE frame iterator."""
    streams = open_streams(req, runtime, prompt)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices, usage=None) -> str:
        c = ChatCompletionChunk(id=cid, created=created, model=runtime.model_id, choices=choices, usage=usage)
        body = c.model_dump(exclude={"usage"} if not include_usage else None)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def frames():
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: TextStream):
            try:
                async for piece in s:
                    await merged.put((i, piece))
            finally:
                await merged.put((i, None))

        tasks = []
        try:
            for i in range(len(streams)):
                yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
            tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
            left = len(streams)
            while left:
                i, piece = await merged.get()
                if piece is None:
                    left -= 1
                    yield chunk([ChunkChoice(index=i, delta=Delta(sparkchat_parts=streams[i].parts),
                                             finish_reason=_finish_reason(streams[i]))])
                elif piece:  # "" marks a tool use: its parts come with the last chunk
                    yield chunk([ChunkChoice(index=i, delta=Delta(content=piece))])
            if include_usage:
                yield chunk([], _usage(prompt, streams))
            yield "data: [DONE]\n\n"
        finally:  # normal end, or the client went away: free every row now
            for s in streams:
                s.cancel()
            for t in tasks:
                t.cancel()

    return frames()
