"""The response that carries server-sent events: each event is one ASGI send, from the request's own task.

Starlette's StreamingResponse runs each response as two tasks under an anyio task group (one sends, one
waits for the client to leave), because uvicorn's send does not fail once the client has gone: every
event then costs a hop between tasks. Here the request's own task sends, and a plain asyncio task that
waits for the disconnect cancels it; the event iterator's `finally` (which cancels its engine requests)
runs either way, as before.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from starlette.responses import Response


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None):
        self.events = events
        self.status_code, self.background = 200, None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        task, gone, ended = asyncio.current_task(), False, False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not ended:  # (after the last send, uvicorn's receive says "disconnect" too)
                gone = True
                task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with contextlib.aclosing(self.events) as events:
                async for event in events:
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            ended = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client left: a normal end for this response
        finally:
            ended = True
            watcher.cancel()
