"""`sparkchat serve` / `python -m serve`: parse flags, check, then start the engine and front-end
processes (serve.supervisor).

The parser needs neither torch nor FastAPI, so `--help` answers at once; they load in main(), after the
checks that need neither: a model directory that is not there, and a port that cannot be had, are said
within a second, before anything loads."""
from __future__ import annotations

import argparse
import errno
import logging
import os
import socket

from sparkchat import paths, start

from . import (API_SERVERS, ENGINE_TIMEOUT_S, KEEP_ALIVE_TIMEOUT_S, MAX_BATCH, MAX_CONNECTIONS, MAX_HEAD_BYTES,
               MAX_HEADER_BYTES, MAX_HEADERS, MAX_QUEUE, MODEL_ID, REQUEST_TIMEOUT_S, STREAM_EVENTS_PER_S,
               STREAM_INTERVAL)

# Before torch loads: idle OpenMP workers sleep instead of spinning. The engine thread interleaves short
# kernels with Python work, and spinning workers steal the cores it needs (decoding on a 2-core CPU
# was several times slower with them spinning; `python -m bench.serve` measures it). No effect on CUDA.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

API_KEY_ENV = "SPARKCHAT_API_KEY"
log = logging.getLogger("sparkchat.serve")


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {port}")
    return port


def _at_least(low, kind):
    def parse(text: str):
        value = kind(text)
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value
    return parse


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sparkchat serve", description="Serve a sparkchat model: OpenAI-compatible "
                                "API under /v1 and a chat page at /.")
    p.add_argument("--model", default=str(paths.CHAT_MODEL),
                   help="model directory: sparkchat's, or a Hugging Face NanoChat one such as `sparkchat export` "
                        "writes (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000, help="port (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require this bearer key on /v1 (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--max-batch", type=int, default=MAX_BATCH, help="sequences decoded together (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=MAX_QUEUE,
                   help="generations (a request's prompts times n) that may wait for a row; a request of more "
                        "is a 400 (default: %(default)s)")
    p.add_argument("--api-servers", type=_at_least(1, int), default=API_SERVERS,
                   help="front-end processes (HTTP, prompts, SSE), each on a core of its own beside the engine's "
                        "process (default: %(default)s)")
    p.add_argument("--stream-interval", type=_at_least(0, float), default=STREAM_INTERVAL,
                   help="least seconds between two events of one stream; the tokens in between come in the next "
                        "(default: %(default)s: each token at once)")
    p.add_argument("--events-per-second", dest="events_per_s", type=_at_least(0, float), default=STREAM_EVENTS_PER_S,
                   help="the most SSE events a second each front end sends over all its streams: with many streams "
                        "each stream's events are spaced to fit, carrying the tokens in between; 0: no limit "
                        "(default: %(default)s)")
    p.add_argument("--no-ui", dest="ui", action="store_false",
                   help="serve the API only, without the chat page at / (Gradio is then not imported; default: the page "
                        "is served)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="leave out the access log's line a request (uvicorn's; default: one a request)")
    p.add_argument("--served-model-name", default=MODEL_ID,
                   help="the model's name in the API: /v1/models and the requests' `model` (default: %(default)s)")
    limits = p.add_argument_group("limits of a connection (docs/serving.md, \"Limits of a connection\")")
    limits.add_argument("--max-head-bytes", type=_at_least(1, int), default=MAX_HEAD_BYTES,
                        help="bytes of a request's line and headers together; more: 431 (default: %(default)s)")
    limits.add_argument("--max-header-bytes", type=_at_least(1, int), default=MAX_HEADER_BYTES,
                        help="bytes of one header line; more: 431 (default: %(default)s)")
    limits.add_argument("--max-headers", type=_at_least(1, int), default=MAX_HEADERS,
                        help="headers of one request; more: 431 (default: %(default)s)")
    limits.add_argument("--request-timeout", type=_positive, default=REQUEST_TIMEOUT_S,
                        help="seconds from a request's first byte until its head and body have arrived; later: "
                             "408 and the connection closes (default: %(default)s)")
    limits.add_argument("--keep-alive-timeout", type=_positive, default=KEEP_ALIVE_TIMEOUT_S,
                        help="seconds a connection may sit idle, before its first request or between two "
                             "(default: %(default)s)")
    limits.add_argument("--max-connections", type=_at_least(1, int), default=MAX_CONNECTIONS,
                        help="open connections of each front end, fewer where the open-file limit (raised to "
                             "its hard limit at start) leaves less; more: 503 with Retry-After (default: %(default)s)")
    limits.add_argument("--engine-timeout", type=_positive, default=ENGINE_TIMEOUT_S,
                        help="seconds the engine may leave a front end's ping unanswered while it lives: then "
                             "/health is 503 and requests fail with 503; the server stops when it stays "
                             "unanswered several times as long (default: %(default)s)")
    return p.parse_args(argv)


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound to host:port now, before the model loads (uvicorn binds only after its
    startup, which starts the load), so a port in use is said at once. It listens once uvicorn serves:
    until then a client is refused, not left waiting while the weights are checked."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise SystemExit(f"sparkchat serve: --host {host} is not an address or a name this machine can "
                         f"resolve ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait out TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = {errno.EADDRINUSE: f"port {port} on {host} is in use by another process (another `sparkchat serve`?): "
                                 f"stop it, or pass --port with a free one",
               errno.EACCES: f"this user may not listen on port {port} (ports below 1024 need privileges): "
                             f"pass --port with one above 1023",
               errno.EADDRNOTAVAIL: f"{host} is not an address of this machine: pass --host 127.0.0.1 (this "
                                    f"machine only) or 0.0.0.0 (every interface)"}
        raise SystemExit(f"sparkchat serve: {why.get(e.errno, f'cannot listen on {host}:{port}: {e.strerror}')}") from None
    return sock


def main(argv=None) -> None:
    args = parse_args(argv)
    missing = start.missing_model(args.model)
    if missing:
        raise SystemExit(f"sparkchat serve: {missing}")
    sock = bind(args.host, args.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from model.model_dir import ModelDirError, verify_model_dir
    try:  # before the port listens: a damaged model stops here, instead of a server that stays unhealthy
        verify_model_dir(args.model)
    except ModelDirError as e:
        raise SystemExit(f"sparkchat serve: {e}") from None
    from model.device import resolve_device
    try:  # a device this machine lacks stops here too, not in the engine's load after the port opened
        resolve_device(args.device)
    except ValueError as e:
        raise SystemExit(f"sparkchat serve: --device {e}; leave --device out to use what there is") from None
    from .supervisor import run
    settings = dict(model_dir=args.model, device=args.device, api_key=args.api_key or None, max_batch=args.max_batch,
                    max_queue=args.max_queue, model_id=args.served_model_name, stream_interval=args.stream_interval,
                    events_per_s=args.events_per_s, ui=args.ui, engine_timeout=args.engine_timeout)
    limits = dict(max_head_bytes=args.max_head_bytes, max_header_bytes=args.max_header_bytes,
                  max_headers=args.max_headers, request_timeout=args.request_timeout,
                  keep_alive_timeout=args.keep_alive_timeout, max_connections=args.max_connections)
    host = f"[{args.host}]" if ":" in args.host else args.host
    log.info("serving on http://%s:%d with %d front-end process(es) (%sthe API under /v1; /health answers 200 "
             "once the model has loaded)", host, sock.getsockname()[1], args.api_servers,
             "the chat page at /, " if args.ui else "")
    raise SystemExit(run(settings, sock, args.api_servers, access_log=args.access_log, limits=limits))


if __name__ == "__main__":
    main()
