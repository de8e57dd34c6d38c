"""Completions logic (OpenAI's legacy /v1/completions): prompts as text or token ids, no chat template.

Each prompt runs as `n` engine requests, all in the same batch; choice k*n + j is prompt k's j-th. A
text prompt is a document: it starts after <|bos|>, as documents did in pretraining, and that id is
not echoed (so the text's first token has a logprob too); token ids are used exactly as given. With
`echo`, a choice's text starts with its prompt and, with `logprobs`, its logprobs with the prompt's
(scored in the prefill); `max_tokens: 0` then scores a text without generating: what log-likelihood
evaluations (lm-evaluation-harness's `local-completions`) ask for.
"""
from __future__ import annotations

import codecs
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Request

from model.requests import Token

from . import serving
from .structured import guided_grammar
from .errors import APIError
from .runtime import Runtime, TextStream
from .sse import Last
from .schemas import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Usage


@dataclass
class Prompt:
    ids: list[int]
    echo: str  # the text an echo shows
    hidden: int  # leading ids not shown (the <|bos|> before a text)


def check(req: CompletionRequest, runtime: Runtime) -> list[Prompt]:
    """Everything a schema cannot say; returns the prompts."""
    serving.check_common(req, runtime)
    guided_grammar(req, runtime)  # a bad one: a 400 before any work
    tok, out, room = runtime.tokenizer, [], 0 if req.max_tokens == 0 else 1
    for k, p in enumerate(req.prompts()):
        fewest = 1 + runtime.fewest_tokens([p]) if isinstance(p, str) else 0
        if fewest + room > runtime.context_len:  # found without tokenizing (a 1 MB prompt takes seconds)
            raise APIError(400, f"This model's maximum context length is {runtime.context_len} tokens; prompt {k} "
                                f"has at least {fewest} tokens. Please shorten the prompt.", "prompt",
                           "context_length_exceeded")
        where = "prompt" if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else f"prompt[{k}]"
        if isinstance(p, str):
            out.append(Prompt([tok.bos_id] + tok.encode(p), p, 1))
            continue
        bad = next((i for i in p if not 0 <= i < runtime.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"Invalid value for '{where}': token {bad} is outside the vocabulary "
                                f"(0..{runtime.vocab_size - 1})", where, "invalid_value")
        out.append(Prompt(list(p), tok.decode(list(p)), 0))
    for k, p in enumerate(out):
        if len(p.ids) + room > runtime.context_len:
            raise APIError(400, f"This model's maximum context length is {runtime.context_len} tokens; prompt {k} "
                                f"has {len(p.ids)} tokens{', leaving no room for a completion' if room else ''}. "
                                f"Please shorten the prompt.", "prompt", "context_length_exceeded")
    return out


async def _streams(req: CompletionRequest, runtime: Runtime, prompts: list[Prompt]) -> list[TextStream]:
    scored = req.logprobs if req.echo else None  # the prompt's logprobs only when they are shown
    grammar = guided_grammar(req, runtime)
    jobs = [(p.ids, serving.sampling(req, runtime, j, req.max_tokens, logprobs=req.logprobs, prompt_logprobs=scored,
                                     grammar=grammar))
            for p in prompts for j in range(req.n)]
    return await serving.open_streams(runtime, jobs, req.stop_list(), "prompt", chat=False)


class _Logprobs:
    """Builds one choice's logprobs, in parts (a stream's chunks), with each token's text offset."""

    def __init__(self, runtime: Runtime):
        self.tok = runtime.tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.offset = 0

    def _token(self, i: int) -> tuple[str, bytes]:
        b = self.tok.token_bytes(i)
        return serving.token_str(b), b

    def part(self, entries: list[tuple[int, float | None, list | None]], generated: bool = False) -> CompletionLogprobs:
        """entries: (id, logprob, top (id, logprob) pairs), None for a prompt's first id. `generated`: the
        reply's ids, whose text leaves special ids out (an echoed prompt's text shows their names)."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        special = self.tok.special_ids if generated else ()
        for i, lp, top in entries:
            text, b = self._token(i)
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.top_logprobs.append(None if top is None else {self._token(j)[0]: v for j, v in top})
            out.text_offset.append(self.offset)
            if i not in special:
                self.offset += len(self.utf8.decode(b))
        return out

    def prompt(self, p: Prompt, s: TextStream) -> CompletionLogprobs:
        scored = s.prompt_logprobs
        if scored is None:  # the request ended before its prompt was read (an engine error)
            return self.part([(i, None, None) for i in p.ids[p.hidden:]])
        entries = [(p.ids[0], None, None)] + [(i, lp, top) for i, lp, top in
                                              zip(p.ids[1:], scored.logprobs, scored.top)]
        return self.part(entries[p.hidden:])

    def tokens(self, tokens: list[Token]) -> CompletionLogprobs:
        return self.part([(t.id, t.logprob, t.top) for t in tokens], generated=True)


def _merge(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    return CompletionLogprobs(**{f: [x for p in parts for x in getattr(p, f)] for f in CompletionLogprobs.model_fields})


def _usage(prompts: list[Prompt], streams: list[TextStream]) -> Usage:
    read = sum(len(p.ids) for p in prompts)
    done = sum(s.completion_tokens for s in streams)
    return Usage(prompt_tokens=read, completion_tokens=done, total_tokens=read + done)


def _response(req: CompletionRequest, runtime: Runtime, choices, usage=None, cid=None, created=None) -> Completion:
    return Completion(id=cid or f"cmpl-{uuid.uuid4().hex}", created=created or int(time.time()),
                      model=runtime.model_id, choices=choices, usage=usage)


async def complete(req: CompletionRequest, runtime: Runtime, prompts: list[Prompt], raw: Request) -> Completion:
    streams = await _streams(req, runtime, prompts)
    texts = await serving.collect(streams, raw)
    serving.check_failed(streams)
    choices = []
    for c, (text, s) in enumerate(zip(texts, streams)):
        p = prompts[c // req.n]
        logprobs = None
        if req.logprobs is not None:
            lp = _Logprobs(runtime)
            logprobs = _merge(([lp.prompt(p, s)] if req.echo else []) + [lp.tokens(s.tokens)])
        choices.append(CompletionChoice(index=c, text=(p.echo if req.echo else "") + text, logprobs=logprobs,
                                        finish_reason=serving.finish_reason(s)))
    return _response(req, runtime, choices, _usage(prompts, streams))


async def stream(req: CompletionRequest, runtime: Runtime,
                 prompts: list[Prompt]) -> tuple[AsyncIterator[str], Callable[[], None]]:
    """Open the streams now (so errors become HTTP errors), then return the SSE frame iterator and what
    cancels the streams. With echo, a choice's first chunk is its prompt (and the prompt's logprobs)."""
    streams = await _streams(req, runtime, prompts)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    builders = [_Logprobs(runtime) for _ in streams]
    echoed = [not req.echo] * len(streams)

    exclude = {"usage"} if not include_usage else None

    def chunk(choices, usage=None) -> str:
        return serving.sse(_response(req, runtime, choices, usage, cid, created), exclude)

    text = serving.TextChunks(lambda c, t: _response(req, runtime, [CompletionChoice(index=c, text=t)], None, cid,
                                                     created), exclude)

    def choice(c: int, text: str, finish: bool = False) -> CompletionChoice:
        s = streams[c]
        tokens = s.take_tokens() if req.logprobs is not None else []
        logprobs = builders[c].tokens(tokens) if tokens else None
        return CompletionChoice(index=c, text=text, logprobs=logprobs,
                                finish_reason=serving.finish_reason(s) if finish else None)

    async def frames():
        held = ""  # events not sent yet: they go out with the next (each event is a write)
        # merged() frees every row when it ends, normally or because the client went away
        async with contextlib.aclosing(serving.merged(streams)) as pieces:
            async for c, piece in pieces:
                if streams[c].finish_reason == "error":
                    held += serving.FAILED_EVENT
                    break
                if not echoed[c]:  # the prompt's logprobs are in: they precede every token
                    echoed[c] = True
                    p = prompts[c // req.n]
                    logprobs = builders[c].prompt(p, streams[c]) if req.logprobs is not None else None
                    held += chunk([CompletionChoice(index=c, text=p.echo, logprobs=logprobs)])
                if piece is None:  # a choice's last chunk
                    held += chunk([choice(c, "", finish=True)])
                    continue
                yield held + (text(c, piece) if req.logprobs is None else chunk([choice(c, piece)]))
                held = ""
        if include_usage and not any(s.finish_reason == "error" for s in streams):
            held += chunk([], _usage(prompts, streams))
        yield Last(held + "data: [DONE]\n\n")

    return frames(), lambda: serving.cancel_all(streams)
