"""schemathesis hooks for bench/fuzz_api.py (loaded by `st run` through SCHEMATHESIS_HOOKS).

Pins `model` (in bodies and in /v1/models/{model_id}) to the served name, $SPARKCHAT_FUZZ_MODEL, in
all but one request of PIN_EVERY, so that valid requests get past the model check and reach generation.
"""
from __future__ import annotations

import itertools
import os

import schemathesis

PIN_EVERY = 10
_count = itertools.count(1)


@schemathesis.hook
def before_call(context, case, kwargs):
    if next(_count) % PIN_EVERY == 0:
        return  # this one keeps its fuzzed model: the 404 path
    model = os.environ["SPARKCHAT_FUZZ_MODEL"]
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = model
    if case.path_parameters and "model_id" in case.path_parameters:
        case.path_parameters["model_id"] = model
