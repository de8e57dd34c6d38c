"""The response that carries server-sent events, sent by a task of its own.

Starlette's StreamingResponse runs each response as two tasks under an anyio task group (one sends, one
waits for the client to leave), and uvicorn's send does not fail once the client has gone. Here a plain
asyncio task sends (`_pump`) and another waits for the disconnect and cancels it; the request's task
only waits for the sender. The sender is a task of its own because a task resumes through every frame
it is suspended in: the request's task sits under some twenty frames of uvicorn, middleware and routing,
and resuming it once an event cost more than the event's own work (cProfile, 128 streams).

`on_close` (which cancels the response's engine requests) runs when the response ends, however it ends:
not the event iterator's own `finally`, which never runs if the sender was cancelled before the iterator
began (the client gone while uvicorn waited, in the response start, for its socket to drain).

The response start goes through every middleware; the events go straight to the server's own send
(`SERVER_SEND`, put in the scope by serve.api's app), past four or five middleware send wrappers an
event: the middleware here look only at the response start (its status, whether it began), and none
rewrites a body.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

from starlette.responses import Response


class Last(str):
    """An event after which the stream ends: it goes out with the body's end, in one write (a response's
    closing events are joined into one `Last`, not sent one write each)."""


SERVER_SEND = "sparkchat.server_send"  # the scope key of the ASGI server's send (serve.api.App)


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None,
                 on_close: Callable[[], None] | None = None):
        self.events, self.on_close = events, on_close
        self.status_code, self.background = 200, None
        self.init_headers(headers)

    async def _pump(self, send, body_send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async with contextlib.aclosing(self.events) as events:
            async for event in events:
                last = type(event) is Last
                await body_send({"type": "http.response.body", "body": event.encode(), "more_body": not last})
                if last:
                    return
        await body_send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        pump, gone = asyncio.create_task(self._pump(send, scope.get(SERVER_SEND, send))), False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not pump.done():  # (after the last send, uvicorn's receive says "disconnect" too)
                gone = True
                pump.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await pump  # cancelling this task (the server stopping) cancels the sender too
        except asyncio.CancelledError:
            if not gone:
                raise
            # the client left: a normal end for this response
        finally:
            pump.cancel()
            watcher.cancel()
            if self.on_close is not None:
                self.on_close()
