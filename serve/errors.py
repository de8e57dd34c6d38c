"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Every failure under /v1 goes through here, including FastAPI's validation errors and unknown routes,
so a client never sees a bare 422 or an HTML 404, and bad input never becomes a 500.
"""
from __future__ import annotations

import logging
import re
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("sparkchat.serve")

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "invalid_request_error")
        self.headers = headers


def engine_stopped(why: str) -> APIError:
    """The 503 of a request that finds the engine gone (its channel ended)."""
    return APIError(503, f"The engine stopped: {why}", code="engine_stopped")


def engine_stalled(why: str) -> APIError:
    """The 503 of a request that finds the engine hung (serve.watchdog), or whose submit it left unanswered."""
    return APIError(503, f"The engine is not answering: {why}. Retry later.", code="engine_stalled")


def _printable(text: str | None) -> str | None:
    """Text that can be written as UTF-8: a lone surrogate the client sent (and an error quotes) as its
    escape, so the error itself never fails to encode."""
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param=None, code=None, type=None) -> dict:
    return {"error": {"message": _printable(message), "type": type or TYPES.get(status, "invalid_request_error"),
                      "param": _printable(param), "code": code}}


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _located(loc, body, kind: str) -> str | None:
    """pydantic's error location as the request's own path: ("body", "messages", 0, "role") ->
    "messages[0].role". A step the body does not hold is a union branch's label (pydantic names the
    branch it tried: "str", "list[TextPart]", ...) and is left out; a missing field is the last step."""
    out, node = "", body
    steps = list(loc[1:] if loc and loc[0] == "body" else loc)
    for n, part in enumerate(steps):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (kind == "missing" and n == len(steps) - 1):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _depth(path: str | None) -> int:
    return 0 if path is None else 1 + path.count(".") + path.count("[")


def _json_kind(value) -> str:
    """A value's type as JSON names it."""
    for t, name in ((bool, "a boolean"), (str, "a string"), (int, "an integer"), (float, "a number"),
                    (list, "an array"), (dict, "an object")):
        if isinstance(value, t):
            return name
    return "null" if value is None else type(value).__name__


def _num(bound) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"  # a float bound: 2, not 2.0


def _show(value) -> str:
    """A value as an error quotes it: a short one as written, a long one cut, a list or object by its kind."""
    if not isinstance(value, (str, int, float)):
        return _json_kind(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:50] + "...(cut)"


# pydantic's "is not of this type" errors, as JSON names the type expected
EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
            "list_type": "an array", "dict_type": "an object", "model_type": "an object",
            "model_attributes_type": "an object"}

# the rule each kind of pydantic error says was broken, in the API's words (JSON types, the bound, the
# value given); a kind missing here keeps pydantic's own message
RULES = {
    "greater_than_equal": lambda c, v: f"must be >= {_num(c['ge'])} (got {_show(v)})",
    "greater_than": lambda c, v: f"must be > {_num(c['gt'])} (got {_show(v)})",
    "less_than_equal": lambda c, v: f"must be <= {_num(c['le'])} (got {_show(v)})",
    "less_than": lambda c, v: f"must be < {_num(c['lt'])} (got {_show(v)})",
    "finite_number": lambda c, v: "must be a finite number (not NaN or Infinity)",
    "too_long": lambda c, v: f"must have at most {c['max_length']} item{'s' * (c['max_length'] != 1)} "
                             f"(got {c['actual_length']})",
    "too_short": lambda c, v: f"must have at least {c['min_length']} item{'s' * (c['min_length'] != 1)}",
    "string_too_short": lambda c, v: f"must be at least {c['min_length']} character{'s' * (c['min_length'] != 1)} long",
    "string_too_long": lambda c, v: f"must be at most {c['max_length']} characters long",
    "string_unicode": lambda c, v: "must be valid Unicode: it holds a lone surrogate",
    "literal_error": lambda c, v: f"{_show(v)} is not supported (supported: {c['expected']})",
    "union_tag_invalid": lambda c, v: f"{c['tag']!r} is not supported (supported: {c['expected_tags']})",
    "union_tag_not_found": lambda c, v: f"needs a '{c['discriminator'].strip(chr(39))}' field",
    "none_required": lambda c, v: "this server does not support it: leave it out, or send null",
    "value_error": lambda c, v: str(c["error"]),
}


def _rule(error: dict) -> str:
    rule = RULES.get(error["type"])
    try:
        return rule(error.get("ctx") or {}, error.get("input")) if rule else error.get("msg", "invalid")
    except (KeyError, TypeError):  # a context this pydantic does not give: its own words
        return error.get("msg", "invalid")


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """One message for the error that says most: pydantic reports every union branch it tried (a list of
    five stop strings fails the string branch too), and the branch that got past its type check and went
    deepest into the input is the rule the client broke. When every branch only refused the type, the
    message lists the types that would have been taken."""
    body = getattr(exc, "body", None)
    errors = [(e, _located(e.get("loc", ()), body, e.get("type", ""))) for e in exc.errors()]
    if not errors:
        return error_response(400, "Invalid request", None, "invalid_value")
    first, param = max(errors, key=lambda ep: (ep[0].get("type") not in EXPECTED, _depth(ep[1])))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return error_response(400, f"Unrecognized request argument supplied: {param}", param)
    if kind == "json_invalid":
        return error_response(400, "The request body is not valid JSON", None, "invalid_value")
    if kind == "missing":
        if param is None:
            return error_response(400, "The request needs a JSON body", None, "invalid_value")
        return error_response(400, f"Missing required parameter: '{param}'", param, "missing_required_parameter")
    if kind in EXPECTED:
        kinds = list(dict.fromkeys(EXPECTED[e["type"]] for e, p in errors if p == param and e.get("type") in EXPECTED))
        either = ", ".join(kinds[:-1]) + " or " + kinds[-1] if len(kinds) > 1 else kinds[0]
        rule = f"must be {either} (got {_json_kind(first.get('input'))})"
    else:
        rule = _rule(first)
    message = f"Invalid value for '{param}': {rule}" if param else f"The request body {rule}"
    return error_response(400, message, param, "invalid_value")


def _long_integer_key(body: bytes) -> str | None:
    """The key whose value is the first integer of too many digits in `body`, when it is an object's
    member (json's error says neither where nor which)."""
    m = re.search(rb'"((?:[^"\\]|\\.){1,64})"\s*:\s*-?\d{%d}' % (sys.get_int_max_str_digits() + 1), body)
    return m.group(1).decode("utf-8", "replace") if m else None


def _too_many_digits(cause: BaseException | None) -> bool:
    return isinstance(cause, ValueError) and "digits" in str(cause)  # Python's int limit (CVE-2020-10735)


def _unparsed(cause: BaseException | None, body: bytes) -> str:
    """Why FastAPI could not parse `body` (its 400 keeps the reason only as the cause)."""
    if isinstance(cause, UnicodeDecodeError):
        return f"The request body is not UTF-8 (byte {cause.start}): send JSON, encoded as UTF-8"
    if _too_many_digits(cause):
        key = _long_integer_key(body)
        return (f"The request body could not be read as JSON: {f'{key!r} is' if key else 'it holds'} an integer "
                f"of over {sys.get_int_max_str_digits()} digits")
    if isinstance(cause, ValueError):
        return f"The request body could not be read as JSON: {cause}"
    return "The request body could not be read: send JSON, encoded as UTF-8"


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code, exc.type),
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if errors and isinstance(errors[0].get("input"), bytes):  # FastAPI left a body it did not take for JSON
            kind = request.headers.get("content-type")
            return error_response(400, f"The request body must be JSON, sent with 'Content-Type: application/json' "
                                       f"({f'got {kind!r}' if kind else 'no Content-Type was sent'})", None,
                                  "invalid_value")
        return validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        messages = {404: f"Unknown URL {request.url.path}", 405: f"Method {request.method} is not allowed"}
        if exc.status_code == 400:  # FastAPI's parse error (its body read already, and so kept: the one case read)
            messages[400] = _unparsed(exc.__cause__, await request.body() if _too_many_digits(exc.__cause__) else b"")
        return error_response(exc.status_code, messages.get(exc.status_code, str(exc.detail)),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return error_response(500, "The server had an error while processing your request")
