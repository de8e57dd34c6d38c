"""A chat engine wired from a loaded model directory (`model.model_dir.load_model_dir`).

The engine itself works on ids only and knows nothing of chat; this is the one place that turns the chat
format's stop tokens (model.chat.STOP_TOKENS) into the ids that end a reply, says which ids delimit a
calculator call, and whether the model may call the calculator at all (generation.json's `tool_use`;
how its defaults fill in the sampling values a caller leaves out: model.requests.sampling_params). The terminal chat, the
evaluate and rl stages and the server all build their engine here; `run_all` runs a batch of requests on one.
"""
from __future__ import annotations

import threading

from .calculator import calculator_tool
from .chat import STOP_TOKENS
from .engine import Engine, EngineConfig
from .grammar import Grammars
from .requests import Finished, SamplingParams, Token
from .tokenizer import SparkTokenizer


def chat_engine(model, tok: SparkTokenizer, gen: dict, **engine_options) -> Engine:
    """A started Engine over `model` with the chat stop ids, grammars over `tok` (structured outputs and
    tool calls end at <|assistant_end|>), and the calculator tool when `gen["tool_use"]`.

    `engine_options` are the other EngineConfig fields the caller decides (max_batch, max_queue, ...).
    """
    s = tok.special
    tool_use = bool(gen.get("tool_use"))
    cfg = EngineConfig(stop_ids=tuple(s[name] for name in STOP_TOKENS),
                       tool_start=s["<|python_start|>"] if tool_use else None,
                       tool_end=s["<|python_end|>"] if tool_use else None,
                       **engine_options)
    grammars = Grammars(tok.to_str(), model.config.vocab_size, s["<|assistant_end|>"])
    return Engine(model, cfg, tool=calculator_tool(tok) if tool_use else None, grammars=grammars).start()


def run_all(engine: Engine, requests: list[tuple[list[int], SamplingParams]], progress=None
            ) -> list[tuple[list[Token], Finished]]:
    """Runs every (prompt ids, params) request, all submitted at once (`Engine.submit_all`: on an idle engine
    the batches then follow from the requests alone), and waits for all: each one's tokens and its end.
    `progress` (a tqdm bar, say) is updated as requests end. The evaluate and rl stages batch through here."""
    out: list[list[Token]] = [[] for _ in requests]
    ends: list[Finished | None] = [None] * len(requests)
    left = threading.Semaphore(0)

    def sink(ev, i):
        if isinstance(ev, Token):
            out[i].append(ev)
        elif isinstance(ev, Finished):
            ends[i] = ev
            left.release()

    engine.submit_all([(ids, sp, lambda ev, i=i: sink(ev, i)) for i, (ids, sp) in enumerate(requests)])
    for _ in requests:
        left.acquire()
        if progress is not None:
            progress.update()
    return list(zip(out, ends))
