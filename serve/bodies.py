"""Large request bodies are decoded, validated and checked on a thread of their own, not on the event loop.

FastAPI decodes a body's JSON and validates it with pydantic on the loop that serves every other
client of the front end, so a 0.9 MB prompt of 300,000 token ids held /health and every stream for
a quarter of a second, and four of them for a second (bench/results/api-robustness.md, "Hostile
clients"). `OffLoopRoute` gives a route a handler that does both on the front end's body thread for a
body over INLINE_BYTES, and hands FastAPI the validated object (which pydantic then takes as it is);
the route's own check of a large body (rendering, tokenizing) runs on the same thread (`off_loop`).

One thread, not a pool: json and pydantic hold the GIL while they run, so threads side by side only
queue for it, and the loop with them. With one, the loop waits at most for one call into json or
pydantic's core (tens of ms for a body at the size limit), while the validators written in Python
hand the GIL back every few ms. A small body stays on the loop, where a hop to a thread would cost
more than the work.
"""
from __future__ import annotations

import asyncio
import email.message
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request

INLINE_BYTES = 16 * 1024  # a body this small is decoded, validated and checked on the loop (a few ms at most)


def replayed(body: bytes, receive):
    """An ASGI `receive` that gives the body already read, whole, once, then the client's own messages
    (a disconnect): the request goes on as if it had not been read."""
    given = False

    async def replay():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def body_worker() -> ThreadPoolExecutor:
    """A front end's body thread (app.state.body_worker; its lifespan shuts it down)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkchat-body")


async def off_loop(request: Request, fn, *args):
    """fn(*args) on the app's body thread."""
    return await asyncio.get_running_loop().run_in_executor(request.app.state.body_worker, fn, *args)


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (its own rule: application/json or
    application/*+json); any other body it leaves as bytes, and the app refuses it (serve.errors)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


_UNSET = object()


class _ParsedRequest(Request):
    """A request whose JSON was decoded and validated already: `parsed` is the body's model, or the
    exception that decoding raised (FastAPI's own handling of it makes the 400)."""
    parsed: Any = _UNSET

    async def json(self) -> Any:
        if isinstance(self.parsed, Exception):
            raise self.parsed
        return await super().json() if self.parsed is _UNSET else self.parsed


def _parse(field, raw: bytes):
    """(the model, None), (the decoded body, pydantic's errors as FastAPI words them), or (the exception
    decoding raised, None)."""
    try:
        value = json.loads(raw)
    except Exception as e:  # FastAPI's handler of request.json() tells which one it is
        return e, None
    model, errors = field.validate(value, {}, loc=("body",))
    return (value, errors) if errors else (model, None)


class OffLoopRoute(APIRoute):
    """A route whose body, over INLINE_BYTES of JSON, is decoded and validated on the body thread."""

    def get_route_handler(self):
        handler, field = super().get_route_handler(), self.body_field
        if field is None:
            return handler

        async def route(request: Request):
            # read on the request the exception handlers get, so that they find it too (serve.errors)
            raw = await request.body()
            parsed_request = _ParsedRequest(request.scope, replayed(raw, request.receive))
            if len(raw) > INLINE_BYTES and is_json(request.headers.get("content-type")):
                parsed, errors = await off_loop(request, _parse, field, raw)
                if errors:
                    raise RequestValidationError(errors, body=parsed)
                parsed_request.parsed = parsed
            return await handler(parsed_request)
        return route
