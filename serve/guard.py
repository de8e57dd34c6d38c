"""ASGI middleware in front of /v1: API key, body size limit, and the request counter.

Checks run before FastAPI parses anything, in OpenAI's order: 401 without the key, 413 for a body
over the limit (by Content-Length, or while reading a chunked body); then the body is replayed to the
app unchanged.
"""
from __future__ import annotations

import hmac
import json

from .errors import error_body

COUNTED = ("/v1/chat/completions", "/v1/completions", "/v1/responses")  # what sparkchat_requests_total counts


class V1Guard:
    def __init__(self, app, max_body: int, api_key: str | None = None, metrics=None):
        self.app, self.api_key, self.max_body, self.metrics = app, api_key, max_body, metrics

    async def _reply(self, send, status: int, message: str, code: str, headers=()):
        body = json.dumps(error_body(status, message, None, code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), *headers]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        counted = scope["path"] in COUNTED and self.metrics is not None

        async def send_counted(message):
            if counted and message["type"] == "http.response.start":
                self.metrics.requests.labels(str(message["status"])).inc()
            await send(message)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key:
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not given:
                return await self._reply(send_counted, 401, "You didn't provide an API key: send it as "
                                         "'Authorization: Bearer KEY'", "invalid_api_key",
                                         [(b"www-authenticate", b"Bearer")])
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                return await self._reply(send_counted, 401, "Incorrect API key provided", "invalid_api_key",
                                         [(b"www-authenticate", b"Bearer")])
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send_counted)
        too_big = f"Request body too large: the limit is {self.max_body} bytes"
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await self._reply(send_counted, 413, too_big, "request_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return await self._reply(send_counted, 413, too_big, "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send_counted)
