"""`sparkchat serve` / `python -m serve`: parse flags, build the app, run uvicorn.

The parser needs neither torch nor FastAPI, so `--help` answers at once; they load in main()."""
from __future__ import annotations

import argparse
import logging
import os

from sparkchat import paths

from . import MAX_BATCH, MAX_QUEUE, MODEL_ID

# Before torch loads: idle OpenMP workers sleep instead of spinning. The engine thread interleaves short
# kernels with Python work, and spinning workers steal the cores it needs (decoding on a 2-core CPU
# was several times slower with them spinning; `python -m bench.serve` measures it). No effect on CUDA.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

API_KEY_ENV = "SPARKCHAT_API_KEY"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sparkchat serve", description="Serve a sparkchat model: OpenAI-compatible "
                                "API under /v1 and a chat page at /.")
    p.add_argument("--model", default=str(paths.CHAT_MODEL),
                   help="model directory: sparkchat's, or a Hugging Face NanoChat one such as `sparkchat export` "
                        "writes (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require this bearer key on /v1 (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--max-batch", type=int, default=MAX_BATCH, help="sequences decoded together (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=MAX_QUEUE, help="requests that may wait (default: %(default)s)")
    p.add_argument("--served-model-name", default=MODEL_ID,
                   help="the model's name in the API: /v1/models and the requests' `model` (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from model.model_dir import ModelDirError, verify_model_dir
    try:  # before the port opens: a damaged model stops here, instead of a server that stays unhealthy
        verify_model_dir(args.model)
    except ModelDirError as e:
        raise SystemExit(f"sparkchat serve: {e}") from None
    import uvicorn

    from .api import Settings, create_app
    app = create_app(Settings(model_dir=args.model, device=args.device, api_key=args.api_key or None,
                              max_batch=args.max_batch, max_queue=args.max_queue, model_id=args.served_model_name))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
