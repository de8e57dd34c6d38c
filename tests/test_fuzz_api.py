"""A short property-based fuzz of the live API from its OpenAPI document: schemathesis's runner (valid
and invalid requests to every operation, `model` pinned in 9 of 10 so that valid ones reach
generation). No 5xx, and no schemathesis check fails but the one rule the document cannot state
(ST202: a conversation's roles in order). The long run is `python bench/fuzz_api.py`."""
from __future__ import annotations

import pytest

from bench.fuzz_api import fuzz
from serve.api import Settings, create_app

pytestmark = pytest.mark.timeout(300)


def test_fuzz_api_no_server_error(serve_start, serve_model_dir):
    server = serve_start(create_app(Settings(model_dir=serve_model_dir, ui=False, model_id="fuzzed")))
    stats = fuzz(server.url, "fuzzed", examples=60, seed=1, phases="coverage")  # each field, each bound
    assert stats["server_errors"] == []
    assert 300 <= stats["requests"] <= 1500, stats["requests"]
    assert stats["generated"] >= 20, stats["refused"]  # valid requests got replies, not only refusals
    assert set(stats["schemathesis_failures"]) <= {"ST202"}, stats["schemathesis_summary"]
    chat, text = stats["operations"]["POST /v1/chat/completions"], stats["operations"]["POST /v1/completions"]
    assert chat.get("200") and text.get("200") and chat.get("400") and text.get("400")
    responses = stats["operations"]["POST /v1/responses"]
    assert responses.get("200") and responses.get("400")
