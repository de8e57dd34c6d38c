"""`sparkchat serve` / `python -m serve`: parse flags, check, then start the engine and front-end
processes (serve.supervisor).

The parser needs neither torch nor FastAPI, so `--help` answers at once; they load in main(), after the
checks that need neither: a model directory that is not there, and a port that cannot be had, are said
within a second, before anything loads."""
from __future__ import annotations

import errno
import logging
import os
import socket

from sparkchat import start

from .settings import Settings
from .settings import parse_args as parse_settings

# Before torch loads: idle OpenMP workers sleep instead of spinning. The engine thread interleaves short
# kernels with Python work, and spinning workers steal the cores it needs (decoding on a 2-core CPU
# was several times slower with them spinning; `python -m bench.serve` measures it). No effect on CUDA.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

log = logging.getLogger("sparkchat.serve")
DESCRIPTION = "Serve a sparkchat model: OpenAI-compatible API under /v1 and a chat page at /."


def parse_args(argv=None) -> Settings:
    return parse_settings(argv, "sparkchat serve", DESCRIPTION)


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
    settings = parse_args(argv)
    missing = start.missing_model(settings.model_dir)
    if missing:
        raise SystemExit(f"sparkchat serve: {missing}")
    sock = bind(settings.host, settings.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from model.model_dir import ModelDirError, verify_model_dir
    try:  # before the port listens: a damaged model stops here, instead of a server that stays unhealthy
        verify_model_dir(settings.model_dir)
    except ModelDirError as e:
        raise SystemExit(f"sparkchat serve: {e}") from None
    from model.device import resolve_device
    try:  # a device this machine lacks stops here too, not in the engine's load after the port opened
        device = resolve_device(settings.device)
    except ValueError as e:
        raise SystemExit(f"sparkchat serve: --device {e}; leave --device out to use what there is") from None
    if settings.weights == "fp8":  # so do FP8 weights where they cannot serve, before anything loads
        from model.precision import BackendUnavailable, fp8_weights
        try:
            fp8_weights.check(device)
        except BackendUnavailable as e:
            raise SystemExit(f"sparkchat serve: {e}") from None
    from .supervisor import run
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    log.info("serving on http://%s:%d with %d front-end process(es) (%sthe API under /v1; /health answers 200 "
             "once the model has loaded)", host, sock.getsockname()[1], settings.api_servers,
             "the chat page at /, " if settings.ui else "")
    raise SystemExit(run(settings, sock))


if __name__ == "__main__":
    main()
