"""The server's knobs: one dataclass holds each one's name, default, allowed range and help. `sparkchat
serve`'s flags are made from its fields (`parser`), every process of the server gets the same object,
and a bad value is refused in one place (`__post_init__`), whether it came from a flag or from code.

Needs neither torch nor FastAPI, so `sparkchat serve --help` answers at once.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from model.precision.options import SERVE_WEIGHTS
from model.requests import MAX_BATCH, MAX_QUEUE
from sparkchat import paths

API_KEY_ENV = "SPARKCHAT_API_KEY"


def knob(default, help: str, flag: str | None = None, low=None, high=None, above=None, choices=None,
         env: str | None = None, cli: bool = True):
    """A field of Settings: `help` for its flag (`flag`, default --the-field-name; `cli` False: no flag, set
    by the server's own processes), the range (`low` and `high` included, `above` not) or the choices it must
    lie in, and an environment variable that gives its default on the command line."""
    return field(default=default, metadata={"help": help, "flag": flag, "low": low, "high": high, "above": above,
                                            "choices": choices, "env": env, "cli": cli})


@dataclass
class Settings:
    model_dir: Path = knob(paths.CHAT_MODEL, "model directory: sparkchat's, or a Hugging Face NanoChat one such as "
                           "`sparkchat export` writes", flag="--model")
    host: str = knob("127.0.0.1", "bind address")
    port: int = knob(8000, "port", low=0, high=65535)
    api_key: str | None = knob(None, f"require this bearer key on /v1 (default: ${API_KEY_ENV}, else none)",
                               env=API_KEY_ENV)
    device: str | None = knob(None, "torch device (default: cuda if available, else cpu)")
    max_batch: int = knob(MAX_BATCH, "sequences decoded together (KV-cache rows)", low=1)
    max_queue: int = knob(MAX_QUEUE, "generations (a request's prompts times n) that may wait for a row; beyond "
                          "that a 429, and a request of more is a 400", low=0)
    api_servers: int = knob(1, "front-end processes (HTTP, prompts, SSE), each on a core of its own beside the "
                            "engine's process", low=1)
    stream_interval: float = knob(0.0, "least seconds between two events of one stream; the tokens in between "
                                  "come in the next (0: each token at once)", low=0.0)
    # Each SSE event costs a front end a task wake-up, an ASGI send and a socket write whatever it carries
    # (bench/results/serving.md, "What an event costs"); 1000 rather than 2000: less of the server's CPU a
    # token at 128 CPU streams (serving.md, "The server's CPU a token at 128 CPU streams"), and still eight
    # events a second to each of 128 streams.
    events_per_s: float = knob(1000.0, "the most SSE events a second each front end sends over all its streams: "
                               "with many streams each stream's events are spaced to fit, carrying the tokens in "
                               "between; 0: no limit", flag="--events-per-second", low=0.0)
    # (a switch's help says what its --no- flag does)
    ui: bool = knob(True, "serve the API only, without the Gradio chat page at / (Gradio is then not imported)")
    access_log: bool = knob(True, "leave out uvicorn's access-log line a request")
    model_id: str = knob("sparkchat", "the model's name in the API: /v1/models and the requests' `model`",
                         flag="--served-model-name")
    # 1 MiB: far above any prompt that fits the context
    weights: str = knob(SERVE_WEIGHTS[0], "how the Linear weights are held: bf16 (fp32 on a CPU), or fp8 (e4m3, a "
                        "scale per output channel, quantised at load from the checkpoint; a GPU with FP8 tensor cores, "
                        "sm_89+; docs/serving.md, 'FP8 weights')", choices=SERVE_WEIGHTS)
    max_body: int = knob(1 << 20, "the largest request body /v1 reads, in bytes; beyond it a 413",
                         flag="--max-body-bytes", low=1)
    # limits of a connection (serve.limits; docs/serving.md, "Limits of a connection"); Apache httpd's
    # defaults where it has one (LimitRequestFieldSize, LimitRequestFields)
    max_head_bytes: int = knob(64 * 1024, "bytes of a request's line and headers together; more: 431", low=1)
    max_header_bytes: int = knob(8190, "bytes of one header line; more: 431", low=1)
    max_headers: int = knob(100, "headers of one request; more: 431", low=1)
    request_timeout: float = knob(30.0, "seconds from a request's first byte until its head and body have arrived; "
                                  "later: 408 and the connection closes", above=0)
    keep_alive_timeout: float = knob(5.0, "seconds a connection may sit idle, before its first request or between "
                                     "two (uvicorn's default)", above=0)
    max_connections: int = knob(1000, "open connections of each front end, fewer where the open-file limit (raised "
                                "to its hard limit at start) leaves less; more: 503 with Retry-After", low=1)
    engine_timeout: float = knob(5.0, "seconds the engine may leave a front end's ping unanswered while it lives: "
                                 "then /health is 503 and requests fail with 503; the server stops when it stays "
                                 "unanswered several times as long (serve.watchdog)", above=0)
    # set by `sparkchat serve` for its front ends, not flags
    engine_address: str | None = knob(None, "the Unix socket of a running engine process; None: the app starts "
                                      "one of its own", cli=False)
    engine_authkey: bytes | None = knob(None, "that engine process's key", cli=False)
    serve_while_loading: bool = knob(True, "take connections while the engine loads (answering 503); False: none "
                                     "until it has, as `sparkchat serve` starts every front end but its first, so "
                                     "the kernel never hands a connection to a front end that cannot serve it",
                                     cli=False)

    def __post_init__(self):
        self.model_dir = Path(self.model_dir)
        for f in fields(self):
            low, high, value = f.metadata["low"], f.metadata["high"], getattr(self, f.name)
            if (low is not None and not value >= low) or (high is not None and not value <= high):
                bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"{flag_of(f)} must be {bounds}, got {value}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{flag_of(f)} must be a finite number, got {value}")
            if f.metadata["above"] is not None and not value > f.metadata["above"]:
                raise ValueError(f"{flag_of(f)} must be > {f.metadata['above']}, got {value}")
            if f.metadata["choices"] and value not in f.metadata["choices"]:
                raise ValueError(f"{flag_of(f)} must be one of {', '.join(f.metadata['choices'])}, got {value!r}")


def flag_of(f) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def parser(prog: str = "sparkchat serve", description: str | None = None) -> argparse.ArgumentParser:
    """The command line: a flag for each field of Settings (a `--no-` flag for a switch, which is on by
    default), its default shown in the help."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    for f in fields(Settings):
        if not f.metadata["cli"]:
            continue
        name, default = flag_of(f), f.default if f.default is not MISSING else None
        if f.metadata["env"]:
            default = os.environ.get(f.metadata["env"], default)
        if isinstance(f.default, bool):
            p.add_argument("--no-" + name[2:], dest=f.name, action="store_false",
                           help=f"{f.metadata['help']} (default: {name[2:]} on)")
            continue
        kind = {int: int, float: float}.get(type(f.default), str)
        shown = "" if f.metadata["env"] or default is None else f" (default: {default})"
        p.add_argument(name, dest=f.name, type=kind, default=default, choices=f.metadata["choices"],
                       metavar=None if f.metadata["choices"] else name[2:].upper().replace("-", "_"),
                       help=f.metadata["help"] + shown)
    return p


def parse_args(argv=None, prog: str = "sparkchat serve", description: str | None = None) -> Settings:
    """Settings from the command line; a value out of range is the parser's error, naming the flag."""
    p = parser(prog, description)
    args = p.parse_args(argv)
    try:
        return Settings(**vars(args))
    except ValueError as e:
        p.error(str(e))
