"""What one front end takes from a connection before any key is checked: the HTTP protocol with limits.

uvicorn's httptools protocol bounds nothing of a request head: httptools joins a header's value piece by
piece (a copy a read, so a 64 MB header costs time in the square of its size, on the event loop), and
any number of headers of any size reach the app. uvicorn's own knobs do not cover it: its
`h11_max_incomplete_event_size` bounds only the (slower, pure-Python) h11 parser, and its
`limit_concurrency` answers over-limit requests only once their head has come (a slow client keeps its
descriptor meanwhile) and without a `Retry-After`. So `LimitedHttp` is uvicorn's httptools protocol plus:

- a head (request line and headers) of at most `max_head_bytes`, a header line of at most
  `max_header_bytes` and at most `max_headers` headers: beyond them a 431, and the connection closes.
  The head's bytes are counted before the parser joins them, so a head is refused after at most one
  read past its limit;
- `request_timeout`: a request's head and body must have arrived this long after its first byte, else
  a 408 and the connection closes; a connection that sends nothing at all is closed after the idle
  keep-alive timeout, as one idle between requests is (uvicorn arms that timer only after a response);
- at most `max_connections` open connections (clipped below the process's file-descriptor limit):
  beyond them a new connection's request is answered 503 with `Retry-After` and the connection closes,
  so a client is told, not left to time out on a server out of descriptors;
- a client that half-closes its socket after its request (shutdown(SHUT_WR)) keeps its response: the
  connection stays open until the response has gone (asyncio closes it on EOF unless told otherwise).

The limits are fields of serve.settings.Settings, each with its flag; docs/serving.md, "Limits of a
connection", says what each does.
"""
from __future__ import annotations

import json
import logging
import resource
import time

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import error_body
from .settings import Settings

log = logging.getLogger("sparkchat.serve")

FD_RESERVE = 64  # descriptors a front end keeps for its own files and the engine's channel
# a connection over the limit has REFUSE_WITHIN_S to send its head, then reads its 503 (a client sends its
# head as soon as it connects); at most REFUSING wait so at once, beyond that one is closed unanswered
# (a burst of connections faster than they can be answered: the descriptors are kept for those served)
REFUSE_WITHIN_S = 0.5
REFUSING = 128
LINGER_S = 0.5  # a refused connection's bytes are read and dropped this long before it closes
RETRY_AFTER_S = 1  # the over-limit 503's Retry-After
WARN_EVERY_S = 10.0  # a refusal of each kind is logged at most this often (an attacker writes no log flood)
REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit (children inherit it): the
    default soft limit (often 1024) is what a few hundred slow clients exhaust. (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:  # (a hard limit of "unlimited" some systems refuse as the soft one)
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, e)
    return soft, hard


def connection_cap(wanted: int) -> int:
    """The connections a front end may hold: `wanted`, or fewer so that its descriptors never run out
    (an accept that fails for want of one is a silent failure for the client)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = max(1, soft - FD_RESERVE - REFUSING) if soft != resource.RLIM_INFINITY else wanted
    if cap < wanted:
        log.warning("at most %d connections a front end (--max-connections %d is above what the open-file "
                    "limit of %d leaves: raise it with `ulimit -n`)", cap, wanted, soft)
    return min(wanted, cap)


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; the response is in `LimitedHttp.refusal`."""


_warned: dict[int, float] = {}


def _warn(status: int, message: str) -> None:
    now = time.monotonic()
    if now - _warned.get(status, -WARN_EVERY_S) >= WARN_EVERY_S:
        _warned[status] = now
        log.warning("%s (refused with %d; the next such refusals for %.0f s go unlogged)", message, status,
                    WARN_EVERY_S)


class LimitedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above (`limits` is set by `http_protocol`)."""
    limits: Settings
    cap: int

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # bytes of the current head, counted by whole reads once a read has ended inside it (so a head is
        # refused at most one read past its limit, and a body's bytes never count)
        self.head_bytes = 0
        self.reading_head = True  # from a request's first byte until its headers are complete
        self.header_count = 0
        self.refusal: tuple[int, str, dict] | None = None
        self.over_limit = False
        self.request_timer = None
        self.eof = False

    # -- limits on the connection --
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.cap:
            self.over_limit = True
            _warn(503, f"{len(self.connections) - 1} connections are open, this front end's limit "
                       f"(--max-connections)")
            if len(self.connections) > self.cap + REFUSING:
                self.transport.close()
                return
            self.request_timer = self.loop.call_later(REFUSE_WITHIN_S, self.transport.close)
        else:  # idle before its first request as between two (uvicorn times only the latter)
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        """The client shut its writing side: keep the connection while a response is owed to it."""
        self.eof = True
        return True if self.cycle is not None and not self.cycle.response_complete else None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.eof and not self.transport.is_closing():
            self.transport.close()  # (no further request can come)

    # -- limits on a request --
    def data_received(self, data: bytes) -> None:
        if self.refusal is not None:  # refused: what else comes is read and dropped until the close
            return
        self._unset_keepalive_if_required()
        in_head = self.reading_head  # the last read ended inside a head: all of this one is head, or ends it
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self._stop_timer()
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self.refusal is None:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
            else:
                self._refuse()
            return
        if in_head and self.reading_head:
            self.head_bytes += len(data)
            if self.head_bytes > self.limits.max_head_bytes:  # counted before httptools joins any more
                self._refusal(431, f"The request's head is over {self.limits.max_head_bytes} bytes (--max-head-bytes)")
                self._refuse()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.reading_head, self.head_bytes, self.header_count = True, 0, 0
        if self.request_timer is None:
            self.request_timer = self.loop.call_later(self.limits.request_timeout, self._timed_out)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_count += 1
        if self.header_count > self.limits.max_headers:
            self._refusal(431, f"The request has over {self.limits.max_headers} headers (--max-headers)")
            raise _Refused
        if len(name) + len(value) > self.limits.max_header_bytes:
            self._refusal(431, f"The request's header {name[:40].decode('latin-1')!r} is over "
                               f"{self.limits.max_header_bytes} bytes (--max-header-bytes)")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.reading_head, self.head_bytes = False, 0
        if self.over_limit:
            self._refusal(503, f"The server has too many open connections ({self.cap} on this front end): "
                               f"retry shortly", {"Retry-After": str(RETRY_AFTER_S)})
            raise _Refused
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._stop_timer()
        super().on_message_complete()

    def _timed_out(self) -> None:
        self.request_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and (self.cycle.response_started or self.cycle.response_complete) \
                and not self.reading_head:
            return  # the app answered with what it had: not a client that is slow to send
        if self.cycle is not None:
            self.cycle.disconnected = True  # (the app's reads end; its sends go nowhere)
            self.cycle.message_event.set()
        self._refusal(408, f"The request did not arrive whole within {self.limits.request_timeout:g} s "
                           f"(--request-timeout)")
        self._refuse()

    def _stop_timer(self) -> None:
        if self.request_timer is not None:
            self.request_timer.cancel()
            self.request_timer = None

    def _refusal(self, status: int, message: str, headers: dict | None = None) -> None:
        self.refusal = (status, message, headers or {})

    def _refuse(self) -> None:
        """Send the refusal, an OpenAI-shaped JSON error, and close (the client's unread bytes dropped)."""
        self._stop_timer()
        self._unset_keepalive_if_required()
        status, message, headers = self.refusal
        if status != 503:  # (the over-limit warning was logged when the connection came)
            _warn(status, message)
        body = json.dumps(error_body(status, message, None, {408: "request_timeout", 431: "request_header_fields_too_large",
                                                              503: "too_many_connections"}[status])).encode()
        head = [f"HTTP/1.1 {status} {REASONS[status]}", "content-type: application/json",
                f"content-length: {len(body)}", "connection: close", *(f"{k}: {v}" for k, v in headers.items())]
        self.transport.write("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        # a close with the client's bytes unread resets the connection, and the client may lose the
        # answer with it: end the writing side, drop what still comes, close a moment later
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


def http_protocol(limits: Settings) -> type[LimitedHttp]:
    """The protocol class for uvicorn.Config(http=...), bound to `limits` (and this process's descriptors)."""
    return type("LimitedHttp", (LimitedHttp,), {"limits": limits, "cap": connection_cap(limits.max_connections)})
