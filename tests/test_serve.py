"""The real server (uvicorn on a loopback port) driven by the official `openai` client."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import SlowModel
from model.chat import display_words, render
from model.engine import PHASES
from serve.api import Settings, create_app
from serve.runtime import Runtime

pytestmark = pytest.mark.timeout(120)

HI = [{"role": "user", "content": "Hello! How are you today?"}]


@pytest.fixture(scope="module")
def server(serve_start, serve_model_dir):
    return serve_start(create_app(Settings(model_dir=serve_model_dir, max_batch=16)))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tight_server(serve_start, serve_model_dir):
    """One batch row, one queue place, 20 ms per step."""
    settings = Settings(model_dir=serve_model_dir, max_batch=1, max_queue=1, ui=False)

    def loader(metrics):
        rt = Runtime.in_process(serve_model_dir, metrics, "cpu", settings.max_batch, settings.max_queue)
        rt.engine.model = SlowModel(rt.engine.model, 0.02)
        return rt

    return serve_start(create_app(settings, loader=loader))


def chat(client, **kw):
    kw.setdefault("model", "sparkchat")
    kw.setdefault("messages", HI)
    return client.chat.completions.create(**kw)


def error_of(excinfo) -> dict:
    body = excinfo.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---- happy paths ----

def test_health_models_and_page(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["sparkchat"] and models.data[0].object == "model"
    assert client.models.retrieve("sparkchat").id == "sparkchat"
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "gradio" in page.text.lower()


def test_non_streaming(client, serve_tokenizer):
    r = chat(client, max_tokens=8, seed=1)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "sparkchat"
    assert isinstance(r.created, int) and len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason == "length"  # the fixture model never ends by itself
    prompt_len = len(render(serve_tokenizer, HI, for_completion=True)[0])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt_len, 8, prompt_len + 8)
    r2 = chat(client, max_completion_tokens=3, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"}])
    assert r2.usage.completion_tokens == 3


def test_streaming_with_usage(client):
    chunks = list(chat(client, max_tokens=10, seed=5, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert content and all(c.choices[0].finish_reason is None for c in content)
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content for c in content)
    assert text == chat(client, max_tokens=10, seed=5).choices[0].message.content  # same seed, same text


def test_raw_sse_frames(server):
    # seeded: an unseeded reply of the tiny model can hold a calculator call, whose parts are not all words
    body = {"model": "sparkchat", "messages": HI, "max_tokens": 6, "stream": True, "seed": 1}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames) and frames[-1] == "data: [DONE]"
    objs = [json.loads(f[6:]) for f in frames[:-1]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(o["choices"][0]["delta"].get("content", "") for o in objs)
    # the delta that finishes the choice carries only the reply's parts (the extension), here all words
    assert objs[-1]["choices"][0]["delta"] == {"sparkchat_parts": [{"type": "text", "text": text}]}
    assert objs[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in objs[0]  # not asked for


def test_a_developer_message_is_the_system_prompt(client, serve_tokenizer):
    """OpenAI's newer models take the system prompt as a `developer` message, and the openai package
    sends it so: the model sees it as the system prompt it was trained with."""
    system = [{"role": "system", "content": "Be brief."}, *HI]
    developer = [{"role": "developer", "content": "Be brief."}, *HI]
    want = chat(client, max_tokens=8, temperature=0, messages=system)
    got = chat(client, max_tokens=8, temperature=0, messages=developer)
    assert got.usage.prompt_tokens == len(render(serve_tokenizer, system, for_completion=True)[0])
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].message.content != chat(client, max_tokens=8, temperature=0, messages=HI).choices[0].message.content


def test_stop_strings(client):
    full = chat(client, max_tokens=24, seed=11).choices[0].message.content
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].isprintable()
                and "\ufffd" not in full[i:i + 2])
    expected = full[:full.index(stop)]
    r = chat(client, max_tokens=24, seed=11, stop=[stop, "never-appears-here"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    chunks = list(chat(client, max_tokens=24, seed=11, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # the parts stop where the words did, so the reply sent back renders what the client saw
    assert display_words(r.choices[0].message.sparkchat_parts) == expected
    assert display_words(chunks[-1].choices[0].delta.sparkchat_parts) == expected


def test_n2_and_seeds(client):
    r = chat(client, max_tokens=12, n=2, seed=3, temperature=2.0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 24
    again = chat(client, max_tokens=12, n=2, seed=3, temperature=2.0)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    single = chat(client, max_tokens=12, seed=3, temperature=2.0)
    assert single.choices[0].message.content == r.choices[0].message.content  # choice i uses seed + i
    other = chat(client, max_tokens=12, seed=4, temperature=2.0)
    assert other.choices[0].message.content != single.choices[0].message.content
    chunks = list(chat(client, max_tokens=5, n=2, stream=True, stream_options={"include_usage": True}))
    finals = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finals == [0, 1] and chunks[-1].usage.completion_tokens == 10


# ---- errors: OpenAI's shape, the right status ----

@pytest.mark.parametrize("kw, param", [
    ({"extra_body": {"foo": 1}}, "foo"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),  # outside the vocabulary
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"temperature": 3}, "temperature"),
    ({"n": 0}, "n"),
    ({"seed": 2**70}, "seed"),
    ({"extra_body": {"top_k": 2**40}}, "top_k"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),  # answers no call
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "messages"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"extra_body": {"store": 0}}, "store"),  # strict types: 0 is not a boolean
    ({"extra_body": {"user": 5}}, "user"),
])
def test_400_invalid_requests(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    err = error_of(e)
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_harmless_openai_fields_are_accepted_and_ignored(client):
    """Fields that only describe the request to a provider: clients send them; they change nothing."""
    from serve.schemas import IGNORED
    values = {"user": "u-1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
              "reasoning_effort": "low", "prompt_cache_key": "c", "safety_identifier": "s"}
    assert set(values) == set(IGNORED)
    plain = chat(client, max_tokens=6, seed=1)
    dressed = chat(client, max_tokens=6, seed=1, extra_body=values)
    assert dressed.choices[0].message.content == plain.choices[0].message.content
    named = chat(client, max_tokens=6, seed=1, messages=[{**HI[0], "name": "bob"}])  # a participant's name
    assert named.choices[0].message.content == plain.choices[0].message.content


def test_405_for_a_known_url_with_another_method(server):
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"  # RFC 9110: a 405 names the methods the URL takes
    for method, url, allow in (("TRACE", "/v1/completions", "POST"), ("OPTIONS", "/v1/models", "GET"),
                               ("POST", "/v1/models/sparkchat", "GET"), ("DELETE", "/health", "GET"),
                               ("PUT", "/metrics", "GET")):
        r = httpx.request(method, server.url + url)
        assert (r.status_code, r.headers.get("allow")) == (405, allow), (method, url)
    assert httpx.get(server.url + "/v1/nope").status_code == 404


def test_400_context_too_long(client):
    long = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 40}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=long)
    err = error_of(e)
    assert err["code"] == "context_length_exceeded" and "context length" in err["message"]


def test_400_bad_json_never_500(server):
    for content in (b"{not json", b"", b"[1, 2]", b'{"model": "sparkchat", "messages": "hi"}'):
        r = httpx.post(server.url + "/v1/chat/completions", content=content,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health").status_code == 200


def test_404_unknown_model_and_url(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model="gpt-4o")
    assert error_of(e)["code"] == "model_not_found"
    r = httpx.get(server.url + "/v1/embeddings")
    assert r.status_code == 404 and "error" in r.json()


def test_413_oversized_body(client):
    with pytest.raises(openai.APIStatusError) as e:
        chat(client, messages=[{"role": "user", "content": "x" * (2 << 20)}])
    assert e.value.status_code == 413 and error_of(e)["code"] == "request_too_large"


def test_401_with_api_key(serve_start, serve_model_dir):
    s = serve_start(create_app(Settings(model_dir=serve_model_dir, api_key="sekret", ui=False)))
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        chat(c, max_tokens=2)
    assert error_of(e)["code"] == "invalid_api_key"
    r = httpx.post(s.url + "/v1/chat/completions", json={"model": "sparkchat", "messages": HI})  # no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
    assert chat(ok, max_tokens=2).usage.completion_tokens == 2
    assert httpx.get(s.url + "/health").status_code == 200  # health and metrics stay open


def test_a_request_larger_than_the_queue_is_a_400(tight_server):
    """Two choices on a server that queues one: no wait would let it run, so a 400 naming the limit
    (a request's generations are queued together; this was a 429 however often the client retried)."""
    c = openai.OpenAI(base_url=tight_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        chat(c, n=2, max_tokens=2)
    err = error_of(e)
    assert err["param"] == "n" and "2 generations" in err["message"] and "at most 1 at once" in err["message"]
    assert chat(c, max_tokens=2).usage.completion_tokens == 2


def test_a_requests_choices_reach_the_engine_together(serve_start, serve_model_dir):
    """n=3: the engine gets the three in one submission (all queued, or none), so on an idle engine
    they are prefilled in the same step."""
    settings = Settings(model_dir=serve_model_dir, max_batch=4, max_queue=8, ui=False)
    s = serve_start(create_app(settings, loader=lambda metrics: Runtime.in_process(
        serve_model_dir, metrics, "cpu", settings.max_batch, settings.max_queue)))
    engine = s.app.state.runtime.engine
    calls, submit_all = [], engine.submit_all
    engine.submit_all = lambda requests: (calls.append(len(requests)), submit_all(requests))[1]
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
    try:
        r = chat(c, n=3, max_tokens=4, seed=1)
    finally:
        del engine.submit_all
    assert calls == [3] and len(r.choices) == 3


def test_429_queue_full_and_cancel_frees_slot(tight_server):
    """One row, one queue place: a third request is refused; cancelling the first lets the second run."""
    c = openai.OpenAI(base_url=tight_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    rt = tight_server.app.state.runtime
    # 100 steps x 60 ms: ~6 s for the second and third requests and the cancel, on a busy machine too
    step, rt.engine.model.delay = rt.engine.model.delay, 0.06
    try:
        queue_full_then_cancel(c, rt)
    finally:
        rt.engine.model.delay = step


def queue_full_then_cancel(c, rt) -> None:
    first = chat(c, max_tokens=100, stream=True)
    next(iter(first))  # the role chunk, sent with the first words: it holds its row
    deadline = time.time() + 10
    while not (rt.engine.num_active == 1 and rt.engine.queue_depth == 0) and time.time() < deadline:
        time.sleep(0.01)  # until it holds the only row (else the second request finds the queue full)
    assert rt.engine.num_active == 1 and rt.engine.queue_depth == 0
    got, done = {}, threading.Event()

    def second():
        got["r"] = chat(c, max_tokens=5)
        done.set()

    threading.Thread(target=second, daemon=True).start()
    deadline = time.time() + 10
    while rt.engine.queue_depth < 1 and time.time() < deadline:
        time.sleep(0.01)
    assert rt.engine.queue_depth == 1
    with pytest.raises(openai.RateLimitError) as e:
        chat(c, max_tokens=5)
    err = error_of(e)
    assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
    assert e.value.response.headers["retry-after"] == "1"  # when to try again (the openai package waits that long)
    # record (not replace) the engine's cancels, with whether the request was unfinished: the second
    # request must get the row because the first was cancelled, not because it ran to its end
    cancels, real_cancel = [], rt.engine.cancel
    rt.engine.cancel = lambda req: (cancels.append(not req.done), real_cancel(req))[1]
    try:
        first.close()  # the client goes away mid-stream
        assert done.wait(10), "the cancelled stream did not free its row"
    finally:
        del rt.engine.cancel
    assert any(cancels), "the first request was not cancelled before it finished"
    assert got["r"].usage.completion_tokens == 5
    deadline = time.time() + 5
    while rt.engine.num_active and time.time() < deadline:
        time.sleep(0.01)
    assert rt.engine.num_active == 0 and rt.engine.queue_depth == 0


def test_health_503_until_loaded(serve_start, serve_model_dir):
    release = threading.Event()

    def loader(metrics):
        release.wait(30)
        return Runtime.in_process(serve_model_dir, metrics, "cpu")

    s = serve_start(create_app(Settings(model_dir=serve_model_dir, ui=False), loader=loader), wait=False)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            r = httpx.get(s.url + "/health")
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    assert r.status_code == 503 and r.json()["status"] == "loading"
    r = httpx.post(s.url + "/v1/chat/completions", json={"model": "sparkchat", "messages": HI})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_loaded"
    release.set()
    s.wait_healthy(30)


def test_a_front_end_that_waits_takes_no_connection_until_loaded(serve_start, serve_model_dir):
    """serve_while_loading=False (`sparkchat serve`'s other front ends, and one started again): a request
    that comes while the engine loads waits in the socket's backlog and is answered once it has, where a
    front end that serves while loading would answer 503 though another could serve it."""
    release = threading.Event()

    def loader(metrics):
        release.wait(30)
        return Runtime.in_process(serve_model_dir, metrics, "cpu")

    s = serve_start(create_app(Settings(model_dir=serve_model_dir, ui=False, serve_while_loading=False),
                               loader=loader), wait=False)
    s.sock.listen()  # as `sparkchat serve`'s socket, listening since its first front end served
    got = {}
    asked = threading.Thread(target=lambda: got.update(r=httpx.post(
        s.url + "/v1/chat/completions", json={"model": "sparkchat", "messages": HI, "max_tokens": 2}, timeout=60)))
    asked.start()
    asked.join(1.0)
    assert asked.is_alive(), got["r"].text  # no answer while loading
    release.set()
    asked.join(60)
    assert got["r"].status_code == 200


def test_bad_model_dir_reports_on_health(serve_start, tmp_path):
    s = serve_start(create_app(Settings(model_dir=tmp_path, ui=False)), wait=False)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            r = httpx.get(s.url + "/health")
            if r.json()["status"] == "error":
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    assert r.status_code == 503 and "config.json" in r.json()["error"]


# ---- concurrency ----

def test_16_concurrent_streams(server):
    from bench.serve_gpu import scrape
    before = scrape(server.url)

    async def one(ac, i):
        chunks = [c async for c in await ac.chat.completions.create(
            model="sparkchat", messages=[{"role": "user", "content": f"Request {i}"}], max_tokens=24,
            seed=i, stream=True, stream_options={"include_usage": True})]
        return chunks

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(16)))

    results = asyncio.run(main())
    for chunks in results:
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
        assert chunks[-1].usage.completion_tokens == 24 and len({c.id for c in chunks}) == 1
    after = scrape(server.url)
    grew = lambda name: after[name] - before.get(name, 0)  # noqa: E731
    # batching: far fewer decode steps (the engine process's count) than tokens
    assert grew("sparkchat_decode_steps_total") < 16 * 24 / 3
    # the latency histograms under that load: a first token and an end for each request, and a gap for each
    # delivery of a stream's tokens after its first (one a step; fewer, larger ones when the front end falls
    # behind the engine): at least one for each chunk of words a client got after its first
    assert grew("sparkchat_time_to_first_token_seconds_count") == 16
    assert grew("sparkchat_e2e_request_latency_seconds_count") == 16
    later_chunks = sum(sum(1 for c in chunks if c.choices and c.choices[0].delta.content) - 1 for chunks in results)
    assert later_chunks <= grew("sparkchat_inter_token_latency_seconds_count") <= 16 * 23
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert grew(f"sparkchat_{name}_seconds_sum") > 0
        assert grew(f'sparkchat_{name}_seconds_bucket{{le="+Inf"}}') == grew(f"sparkchat_{name}_seconds_count")
    # a request's gaps add up to the time from its first delivery to its last, inside its end-to-end time
    # less its first token's: so do the sums
    assert grew("sparkchat_inter_token_latency_seconds_sum") <= \
        grew("sparkchat_e2e_request_latency_seconds_sum") - grew("sparkchat_time_to_first_token_seconds_sum")


def test_metrics(server, client):
    from bench.serve_gpu import scrape
    chat(client, max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        chat(client, temperature=9)
    text = httpx.get(server.url + "/metrics").text
    for name in ("sparkchat_requests_total{status=\"200\"}", "sparkchat_prompt_tokens_total",
                 "sparkchat_completion_tokens_total", "sparkchat_time_to_first_token_seconds_count",
                 "sparkchat_queue_depth", "sparkchat_active_sequences"):
        assert name in text, name
    assert 'sparkchat_requests_total{status="400"}' in text
    # a running total is a counter, named ..._total (Prometheus' rate() and increase() need that); the
    # latencies are histograms
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE sparkchat_"))
    counters = {n for n, kind in types.items() if kind == "counter"}
    assert counters and all(n.endswith("_total") for n in counters), counters
    assert {"sparkchat_decode_steps_total", "sparkchat_engine_cpu_seconds_total"} <= counters
    # (prometheus_client adds a `..._created` gauge, the creation time, beside each counter and histogram)
    assert {n for n, kind in types.items() if kind == "gauge" and not n.endswith("_created")} == {
        "sparkchat_model_loaded", "sparkchat_queue_depth", "sparkchat_active_sequences"}
    assert {n for n, kind in types.items() if kind == "histogram"} == {
        "sparkchat_time_to_first_token_seconds", "sparkchat_inter_token_latency_seconds",
        "sparkchat_e2e_request_latency_seconds"}
    value = scrape(server.url)
    assert value["sparkchat_decode_steps_total"] >= 2 and value["sparkchat_engine_cpu_seconds_total"] > 0
    # the steps' CPU is part of the engine thread's (the rest: waiting for work)
    assert 0 < value["sparkchat_engine_step_cpu_seconds_total"] <= value["sparkchat_engine_cpu_seconds_total"]
    # the thread's CPU is part of its process's
    assert value["sparkchat_engine_cpu_seconds_total"] <= value["sparkchat_engine_process_cpu_seconds_total"]
    # where the steps' wall time went: the read-back wait is part of the decode phase
    phase = {p: value[f'sparkchat_engine_phase_seconds_total{{phase="{p}"}}'] for p in PHASES}
    assert 0 < phase["wait"] <= phase["decode"] and phase["admit"] > 0 and phase["hooks"] > 0
    assert 1 <= value["sparkchat_engine_admissions_total"] <= value["sparkchat_engine_admitted_requests_total"]


# ---- the command line ----

def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--model" in out.stdout and "--api-key" in out.stdout


def test_cli_defaults(monkeypatch):
    from serve.__main__ import parse_args
    monkeypatch.setenv("SPARKCHAT_API_KEY", "k")
    a = parse_args([])
    assert (str(a.model_dir), a.host, a.port, a.api_key) == ("artifacts/model", "127.0.0.1", 8000, "k")
    assert a == Settings(api_key="k")  # the flags' defaults are the server's
    assert parse_args(["--served-model-name", "my-chat"]).model_id == "my-chat"
    assert parse_args(["--no-ui", "--max-batch", "4"]) == Settings(api_key="k", ui=False, max_batch=4)


@pytest.mark.parametrize("flag, value, says", [("--max-batch", "0", "--max-batch must be >= 1, got 0"),
                                               ("--port", "70000", "--port must be in [0, 65535], got 70000"),
                                               ("--stream-interval", "-1", "--stream-interval must be >= 0.0"),
                                               ("--max-batch", "two", "--max-batch: invalid int value: 'two'")])
def test_cli_refuses_a_bad_value_naming_the_flag(flag, value, says):
    out = subprocess.run([sys.executable, "-m", "serve", flag, value], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and says in out.stderr, out.stderr


def test_served_model_name(serve_start, serve_model_dir):
    srv = serve_start(create_app(Settings(model_dir=serve_model_dir, model_id="my-chat", ui=False)))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["my-chat"]
    assert chat(client, model="my-chat", max_tokens=3).model == "my-chat"
    with pytest.raises(openai.NotFoundError):
        chat(client, model="sparkchat", max_tokens=3)



# ---- a reply that uses the calculator: its words once, its parts apart, its history as trained ----

@pytest.fixture(scope="module")
def tool_client(serve_start, conv_tool_model_dir):
    srv = serve_start(create_app(Settings(model_dir=conv_tool_model_dir, ui=False)))
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_tool_using_reply_shows_its_words_once(tool_client, conv_tool_chats):
    question, trained = conv_tool_chats[1]  # a word problem: words, a call, its result, words, "#### 42"
    r = chat(tool_client, messages=[question])
    message = r.choices[0].message
    assert message.content == "We need 12 + 30 = 42."  # no call glued in, no backticks, no answer marker
    assert message.sparkchat_parts == trained["content"]  # everything the model wrote, in order
    chunks = list(chat(tool_client, messages=[question], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].delta.sparkchat_parts == trained["content"]


def test_history_sent_back_with_its_parts_renders_as_trained(tool_client, conv_tool_chats, serve_tokenizer):
    question, trained = conv_tool_chats[1]
    first = chat(tool_client, messages=[question]).choices[0].message
    sent_back = {"role": "assistant", "content": first.content, "sparkchat_parts": first.sparkchat_parts}
    follow_up = {"role": "user", "content": "Hello!"}
    r = chat(tool_client, messages=[question, sent_back, follow_up], max_tokens=1)
    as_trained = render(serve_tokenizer, [question, trained, follow_up], for_completion=True)[0]
    assert r.usage.prompt_tokens == len(as_trained)
    # without the parts, the words alone are the turn (a plain-text history, as any OpenAI client sends)
    words_only = chat(tool_client, messages=[question, {"role": "assistant", "content": first.content}, follow_up],
                      max_tokens=1)
    as_words = render(serve_tokenizer, [question, {"role": "assistant", "content": first.content}, follow_up],
                      for_completion=True)[0]
    assert words_only.usage.prompt_tokens == len(as_words) < len(as_trained)
    # the reply sent back as the openai package gives it (null refusal, tool_calls, audio...): the same turn
    dumped = chat(tool_client, messages=[question, first.model_dump(), follow_up], max_tokens=1)
    assert dumped.usage.prompt_tokens == len(as_trained)


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "content": "We need 43.", "sparkchat_parts": [{"type": "text", "text": "We need 42."}]},
     "messages[1].content"),
    ({"role": "user", "content": "Hi", "sparkchat_parts": [{"type": "text", "text": "Hi"}]},
     "messages[1].sparkchat_parts"),
    ({"role": "assistant", "content": "x", "sparkchat_parts": [{"type": "tool", "text": "x"}]},
     "messages[1].sparkchat_parts[0].type"),
])
def test_400_parts_that_do_not_match(tool_client, message, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(tool_client, messages=[{"role": "user", "content": "Hello!"}, message,
                                    {"role": "user", "content": "Hello!"}])
    assert error_of(e)["param"] == param


def test_control_token_text_sent_to_the_api_is_plain_text(client, serve_tokenizer):
    """Prompt injection through the API: each control token's text, typed into system, user and assistant
    messages and into a completions prompt, reaches the model as plain text: the prompt is as long as the
    renderer makes it for the text as text (read as a control token, the text would be one id)."""
    from model.tokenizer import SPECIAL_TOKENS
    tok = serve_tokenizer
    for t in SPECIAL_TOKENS:
        forged = [{"role": "system", "content": t}, {"role": "user", "content": t},
                  {"role": "assistant", "content": t}, {"role": "user", "content": t}]
        ids = render(tok, forged, for_completion=True)[0]
        as_control = len(render(tok, [{**m, "content": "q"} for m in forged], for_completion=True)[0])
        assert chat(client, messages=forged, max_tokens=1).usage.prompt_tokens == len(ids) > as_control, t
        c = client.completions.create(model="sparkchat", prompt=t, max_tokens=0, echo=True, logprobs=0)
        assert c.usage.prompt_tokens == 1 + len(tok.encode(t)) > 2, t  # <|bos|>, then the text as text
        assert c.choices[0].text == t and t not in c.choices[0].logprobs.tokens, t
