"""schemathesis hooks for bench/fuzz_api.py (loaded by `st run` through SCHEMATHESIS_HOOKS).

Pins `model` (in bodies and in /v1/models/{model_id}) to the served name, $SPARKCHAT_FUZZ_MODEL, in
all but one request of PIN_EVERY, so that valid requests get past the model check and reach generation;
every other pinned chat request goes without the fields whose rules span fields (`plain_chat`).
"""
from __future__ import annotations

import itertools
import os

import schemathesis

PIN_EVERY = 10
_count = itertools.count(1)


# chat fields whose rules span fields the document cannot state (tool_choice needs tools, a tool message
# answers an earlier call, a schema must compile): every other pinned chat request goes without them, so
# that valid requests reach generation; the others fuzz them
CROSS_FIELD = ("tools", "tool_choice", "parallel_tool_calls", "response_format")


def plain_chat(body: dict) -> None:
    for k in CROSS_FIELD:
        body.pop(k, None)
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            for k in ("tool_calls", "tool_call_id"):
                m.pop(k, None)
            if m.get("role") == "tool":
                m["role"] = "user"
            if m.get("content") is None:
                m["content"] = "hi"


@schemathesis.hook
def before_call(context, case, kwargs):
    n = next(_count)
    if n % PIN_EVERY == 0:
        return  # this one keeps its fuzzed model: the 404 path
    model = os.environ["SPARKCHAT_FUZZ_MODEL"]
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = model
        if n % 2 and "messages" in case.body:
            plain_chat(case.body)
    if case.path_parameters and "model_id" in case.path_parameters:
        case.path_parameters["model_id"] = model
