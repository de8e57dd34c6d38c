"""The FastAPI app: routes, lifespan and wiring. Logic lives in serving.py, bodies in schemas.py.

    POST /v1/chat/completions   OpenAI chat completions, JSON or SSE (`stream: true`)
    POST /v1/completions        OpenAI (legacy) completions: text or token-id prompts, echo, logprobs
    POST /v1/responses          OpenAI responses, for text: JSON or SSE events (responses.py)
    GET  /v1/models             the one served model
    GET  /health                503 while the model loads (or failed to, or the engine is hung), else 200
    GET  /metrics               Prometheus text format
    /                           the Gradio chat page (ui.py), same engine

This app is one front end: the engine runs in a process of its own (serve.engine_proc), which the app
starts, or connects to when `Settings.engine_address` (serve/settings.py) names one (`sparkchat serve`'s front ends). It
connects in a background thread started by the lifespan, so the port answers (and /health says 503)
at once; state lives on `app.state`: `settings`, `metrics`, `runtime` (None until loaded).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from . import completions, errors, responses, serving
from .bodies import INLINE_BYTES, OffLoopRoute, body_worker, off_loop
from .errors import APIError, engine_stalled, engine_stopped
from .guard import V1Guard
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .runtime import Runtime
from .settings import Settings
from .watchdog import watch_link
from .sse import SERVER_SEND, EventStream
from .schemas import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ErrorResponse, Model, ModelList

log = logging.getLogger("sparkchat.serve")


def _load_in_background(app: FastAPI, loader: Callable[[], Runtime]) -> threading.Thread:
    loop = asyncio.get_running_loop()

    def run():
        try:
            runtime = loader()
            runtime.link.on_death = app.state.on_engine_lost
            app.state.runtime = runtime.start(loop)
            app.state.metrics.loaded = True
            app.state.watchdog = asyncio.run_coroutine_threadsafe(
                watch_link(runtime.link, app.state.settings.engine_timeout), loop)
            if app.state.on_ready is not None:
                app.state.on_ready()
        except Exception as e:  # /health reports it; the process stays up to say so
            log.exception("loading the model failed")
            app.state.load_error = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=run, name="sparkchat-load", daemon=True)
    t.start()
    return t


def get_runtime(request: Request) -> Runtime:
    runtime = request.app.state.runtime
    if runtime is None:
        error = request.app.state.load_error
        raise APIError(503, f"The model failed to load: {error}" if error else "The model is still loading",
                       code="model_not_loaded")
    if runtime.link.dead:
        raise engine_stopped(runtime.link.dead)
    if runtime.link.stalled:
        raise engine_stalled(runtime.link.stalled)
    return runtime


router = APIRouter(route_class=OffLoopRoute)  # (a large body is decoded and validated off the loop)
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}
STREAMED = {**ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or with `stream`, server-sent events"}}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def answer(endpoint, body, request: Request):
    """A generation request's answer. `endpoint` (serving, completions or responses) checks the body
    beyond its schema (errors are HTTP errors, before any stream starts), then gives the whole response
    or, with `stream`, its server-sent events."""
    runtime = get_runtime(request)
    # a large prompt is rendered and tokenized on the body thread (serve.bodies), so that it holds up no
    # other client's stream. The body's size is the one FastAPI read (cached), so a chunked body without
    # a Content-Length is measured too.
    if len(await request.body()) > INLINE_BYTES:
        checked = await off_loop(request, endpoint.check, body, runtime)
    else:
        checked = endpoint.check(body, runtime)
    if body.stream:
        events, cancel = await endpoint.stream(body, runtime, checked)
        return EventStream(events, headers=SSE_HEADERS, on_close=cancel)
    return await endpoint.complete(body, runtime, checked, request)


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=STREAMED)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await answer(serving, body, request)


@router.post("/v1/completions", response_model=Completion, responses=STREAMED)
async def text_completions(body: CompletionRequest, request: Request):
    return await answer(completions, body, request)


@router.post("/v1/responses", response_model=responses.ResponseObject, responses=STREAMED)
async def create_response(body: responses.ResponsesRequest, request: Request):
    return await answer(responses, body, request)


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(request: Request):
    runtime = get_runtime(request)
    return ModelList(data=[Model(id=runtime.model_id, created=request.app.state.started,
                                 max_model_len=runtime.context_len)])


@router.get("/v1/models/{model_id}", response_model=Model, responses=ERRORS)
async def get_model(model_id: str, request: Request):
    runtime = get_runtime(request)
    if model_id != runtime.model_id:
        raise APIError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")
    return Model(id=runtime.model_id, created=request.app.state.started, max_model_len=runtime.context_len)


@router.get("/health")
async def health(request: Request):
    runtime = request.app.state.runtime
    if runtime is not None and not runtime.link.dead and not runtime.link.stalled:
        return {"status": "ok"}
    error = (runtime.link.dead or runtime.link.stalled) if runtime is not None else request.app.state.load_error
    return JSONResponse({"status": "error" if error else "loading", "error": error}, status_code=503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    m, runtime = request.app.state.metrics, request.app.state.runtime
    if runtime is not None:
        m.engine = await runtime.link.stats()  # None (no engine figures) if it does not answer
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)


# every method a client may send (QUERY: the draft safe method with a body)
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "QUERY"]


async def other_method(request: Request):
    """A URL the API serves, asked with another method: 405 with the methods it takes (RFC 9110), as
    OpenAI's and vLLM's servers answer; any other URL under /v1: 404."""
    path = request.url.path
    allowed = sorted({m for r in router.routes if getattr(r, "endpoint", None) is not other_method
                      and r.path_regex.match(path) for m in getattr(r, "methods", ())})
    if allowed:
        raise APIError(405, f"Method {request.method} is not allowed for {path}", code="method_not_allowed",
                       headers={"Allow": ", ".join(allowed)})
    raise APIError(404, f"Unknown URL {path}", code="unknown_url")


# after every real route, so these only catch what those do not
router.add_api_route("/v1/{path:path}", other_method, methods=METHODS, include_in_schema=False)
for _path in ("/health", "/metrics"):
    router.add_api_route(_path, other_method, methods=[m for m in METHODS if m != "GET"], include_in_schema=False)


class App(FastAPI):
    """The API's app: FastAPI that leaves the ASGI server's own send in each request's scope, for an event
    stream's events (serve.sse says why). A middleware that rewrites bodies would not see them."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(settings: Settings, loader: Callable[[Metrics], Runtime] | None = None) -> FastAPI:
    """One front end. `loader(metrics) -> Runtime` replaces starting or reaching the engine process
    (tests: Runtime.in_process, to reach into the engine)."""
    metrics = Metrics()

    def load() -> Runtime:
        if loader is not None:
            return loader(metrics)
        fields = {"model_id": settings.model_id, "stream_interval": settings.stream_interval,
                  "events_per_s": settings.events_per_s}
        if settings.engine_address:
            return Runtime.connect(settings.engine_address, settings.engine_authkey, metrics, **fields)
        return Runtime.spawn(settings.model_dir, metrics, settings.device, settings.max_batch,
                             settings.max_queue, settings.weights, **fields)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.body_worker = body_worker()  # (a new one each start: the last stop shut the old one)
        thread = _load_in_background(app, load)
        if not settings.serve_while_loading:  # uvicorn takes no connection until this start returns
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 30)
            app.state.body_worker.shutdown(wait=False, cancel_futures=True)
            if app.state.runtime is not None:
                app.state.runtime.close()

    app = App(title="sparkchat", version="0.1.0", lifespan=lifespan)
    app.state.settings, app.state.metrics = settings, metrics
    app.state.runtime, app.state.load_error = None, None
    app.state.body_worker = body_worker()
    app.state.on_engine_lost = None  # called with the reason when the channel to the engine ends
    app.state.on_ready = None  # called once the engine is reached (the supervisor's restart limit)
    app.state.started = int(time.time())
    errors.install(app)
    app.include_router(router)
    app.add_middleware(V1Guard, max_body=settings.max_body, api_key=settings.api_key, metrics=metrics)
    if settings.ui:
        from .ui import mount_ui
        mount_ui(app, settings)
    return app
