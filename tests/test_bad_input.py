"""Bad input to the live API gets a 400 that names the field and the rule it broke, never a 500: text
that is not whole Unicode (a lone surrogate, which JSON's \\ud800 escape makes), numbers that are not
finite, lists over their bound, parts of a kind the server does not take."""
from __future__ import annotations

import json

import httpx
import pytest

from serve.api import Settings, create_app

pytestmark = pytest.mark.timeout(120)

HI = [{"role": "user", "content": "Hello!"}]
LONE = "a\ud800b"  # json.dumps writes it as the escape a client sends: "a\ud800b"


@pytest.fixture(scope="module")
def server(serve_start, serve_model_dir):
    return serve_start(create_app(Settings(model_dir=serve_model_dir, ui=False)))


def post(server, path: str, body: dict) -> httpx.Response:
    # json.dumps, not httpx's json=: it escapes the surrogate (ensure_ascii) and writes NaN as NaN, as
    # Python's and JavaScript's JSON writers do
    return httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=60,
                      headers={"content-type": "application/json"})


def refused(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    return err


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": LONE}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", LONE]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": LONE}, *HI]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "developer", "content": LONE}, *HI]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [*HI, {"role": "assistant", "content": LONE}, *HI]}, "messages[1].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": HI, "stop": LONE}, "stop"),
    ("/v1/chat/completions", {"messages": HI, "user": LONE}, "user"),
    ("/v1/chat/completions", {"messages": HI, "model": LONE}, "model"),  # quoted by the 404: must not reach it
    ("/v1/responses", {"input": LONE}, "input"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": LONE}]}]},
     "input[0].content[0].text"),
    ("/v1/responses", {"input": "Hi", "instructions": LONE}, "instructions"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    budget = {"max_output_tokens": 2} if path == "/v1/responses" else {"max_tokens": 2}
    err = refused(post(server, path, {"model": "sparkchat", **budget, **body}))
    assert err["param"] == param and "surrogate" in err["message"], err
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("body, param, says", [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 items (got 5)"),
    ({"temperature": float("nan")}, "temperature", "must be a finite number"),
    ({"top_p": float("inf")}, "top_p", "must be a finite number"),
    ({"logit_bias": {"5": float("-inf")}}, "logit_bias.5", "must be a finite number"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[0].type", "'image_url' is not supported (supported: 'text')"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "matches none"),
    ({"stop": 5}, "stop", "must be a string or an array (got an integer)"),
    ({"stop": ""}, "stop", "at least 1 character"),
    ({"temperature": 3}, "temperature", "must be <= 2 (got 3)"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[]"}}]}, *HI]},
     "messages[0].tool_calls[0].function.arguments", "must be a JSON object's text"),
    ({"model": None}, "model", "must be a string (got null)"),
    ({"messages": [*HI, {"role": "developer", "content": "Be brief."}]}, "messages[1].role",
     "a developer message may only come first"),
])
def test_the_message_names_the_rule_broken(server, body, param, says):
    err = refused(post(server, "/v1/chat/completions", {"model": "sparkchat", "messages": HI, **body}))
    assert err["param"] == param and says in err["message"], err


def test_a_missing_parameter_is_named_as_openai_names_it(server):
    err = refused(post(server, "/v1/chat/completions", {"messages": HI}))
    assert (err["param"], err["code"], err["message"]) == ("model", "missing_required_parameter",
                                                           "Missing required parameter: 'model'")


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": [1, -2]}, "prompt[1]", "must be >= 0 (got -2)"),
    ({"prompt": [[1], ["a"]]}, "prompt[1][0]", "must be an integer (got a string)"),
    ({"prompt": "x", "n": 9}, "n", "must be <= 8 (got 9)"),
])
def test_completions_messages_name_the_rule_broken(server, body, param, says):
    err = refused(post(server, "/v1/completions", {"model": "sparkchat", **body}))
    assert err["param"] == param and says in err["message"], err


def test_a_body_that_is_not_utf8_is_a_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": "sparkchat", "messages": '
                   b'[{"role": "user", "content": "caf\xe9"}]}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]


def test_a_huge_integer_and_a_body_not_sent_as_json_say_what_is_wrong(server):
    """A 5,000-digit number is past Python's integer limit, and the field is named (not "send UTF-8"); a JSON body sent with
    another Content-Type is told to send it as JSON (not "got bytes")."""
    r = httpx.post(server.url + "/v1/completions", headers={"content-type": "application/json"},
                   content=b'{"model": "sparkchat", "prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}")
    assert r.status_code == 400 and "'max_tokens' is an integer of over 4300 digits" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "sparkchat", "prompt": "Hi"}',
                   headers={"content-type": "text/plain"})
    assert r.status_code == 400, r.text
    assert "'Content-Type: application/json' (got 'text/plain')" in r.json()["error"]["message"], r.text


PAD = " " * (64 * 1024)  # JSON's whitespace: a body over serve.bodies.INLINE_BYTES, decoded off the loop


@pytest.mark.parametrize("raw, says", [
    (b'{"model": "sparkchat", "prompt": [' + b"1, " * 20_000 + b'-1]}', "Invalid value for 'prompt"),
    (b'{"model": "sparkchat", "prompt": "Hi",' + PAD.encode() + b'"max_tokens": }', "not valid JSON"),
    (b'{"model": "sparkchat", "prompt": "Hi",' + PAD.encode() + b'"max_tokens": ' + b"9" * 5000 + b"}",
     "'max_tokens' is an integer of over 4300 digits"),
    (b'{"model": "sparkchat", "prompt": "caf\xe9",' + PAD.encode() + b'"max_tokens": 1}', "UTF-8"),
    (b'{"model": "sparkchat", "prompt": "Hi", "max_tokens": 1, "nosuch": 1}' + PAD.encode(),
     "Unrecognized request argument supplied: nosuch"),
])
def test_a_large_bad_body_says_what_is_wrong_as_a_small_one_does(server, raw, says):
    r = httpx.post(server.url + "/v1/completions", content=raw, timeout=60, headers={"content-type": "application/json"})
    assert says in refused(r)["message"], r.text
