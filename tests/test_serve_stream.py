"""The per-token path of a front end: one channel message per engine step, a stream that fell behind
catching up in one event, the minimum interval between events, the SSE framing without a pydantic
object per chunk, large prompts that hold up no one, and a failed generation told to the client."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import types

import httpx
import openai
import pytest
from conftest import SlowModel, broken_app, post_large_prompts

from model.requests import Finished
from serve import wire
from serve.api import Settings, create_app
from serve.runtime import Runtime, TextStream, Wake
from serve.schemas import ChatCompletionChunk, ChunkChoice, CompletionChoice, Delta
from serve.serving import TextChunks, sse

HI = [{"role": "user", "content": "Hello"}]


def in_process(model_dir, delay: float = 0.0, **settings):
    """An app whose engine runs in this process (so a test can reach it), `delay` seconds a step."""
    s = Settings(model_dir=model_dir, ui=False, **settings)

    def loader(metrics):
        rt = Runtime.in_process(model_dir, metrics, "cpu", max_batch=16, stream_interval=s.stream_interval,
                                events_per_s=s.events_per_s)
        if delay:
            rt.engine.model = SlowModel(rt.engine.model, delay)
        return rt
    return create_app(s, loader=loader)


@pytest.fixture(scope="module")
def server(serve_start, serve_model_dir):
    return serve_start(in_process(serve_model_dir))


def sse_events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("text", ["plain", "", "quote \" and \\ backslash", "line\nbreak\ttab\r", "\x00\x01\x1f\x7f",
                                  "Café 你好 🙂", "</script>", "\u2028\u2029"])
@pytest.mark.parametrize("usage", [False, True])
def test_text_chunks_are_the_pydantic_chunks(text, usage):
    """The template's event is the JSON pydantic writes for the same chunk, and the openai package reads it."""
    exclude = None if usage else {"usage"}

    def chat(i, t):
        return ChatCompletionChunk(id="c1", created=7, model="m", choices=[ChunkChoice(index=i, delta=Delta(content=t))])

    fast = TextChunks(chat, exclude)
    for index in (0, 3):
        ours, theirs = fast(index, text), sse(chat(index, text), exclude)
        assert ours.startswith("data: ") and ours.endswith("\n\n")
        assert json.loads(ours[6:]) == json.loads(theirs[6:])
        parsed = openai.types.chat.ChatCompletionChunk.model_validate_json(ours[6:])
        assert parsed.choices[0].delta.content == text and parsed.choices[0].index == index

    from serve.schemas import Completion
    legacy = TextChunks(lambda i, t: Completion(id="c", created=1, model="m", choices=[CompletionChoice(index=i, text=t)]))
    assert json.loads(legacy(2, text)[6:])["choices"][0] == {"index": 2, "text": text, "logprobs": None,
                                                            "finish_reason": None}


def test_one_channel_message_per_engine_step(server):
    """Eight streams in one batch: each message from the engine carries every stream's token of that
    step (fails with a message per token)."""
    link = server.app.state.runtime.link
    counts, on_message = [], link._on_message
    link._on_message = lambda step: (counts.append(len(step.ids) + len(step.finished)), on_message(step))[1]
    try:
        def one(i):
            with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
                    "model": "sparkchat", "messages": HI, "max_tokens": 24, "seed": i, "stream": True}) as r:
                return sse_events(r)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        del link._on_message
    assert sum(counts) >= 8 * 24  # every token (and each stream's end) came through these messages
    assert sum(counts) / len(counts) >= 3, counts


def test_events_go_straight_to_the_servers_send(serve_start, serve_model_dir):
    """A middleware sees a stream's response start but not its events (they skip every middleware's send
    wrapper: serve.sse), and the client still gets every event (fails when they go through the chain)."""
    seen = []
    app = in_process(serve_model_dir)

    class Watch:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            async def watched(message):
                seen.append(message["type"])
                await send(message)
            stream = scope["type"] == "http" and scope["path"] == "/v1/chat/completions"
            await self.app(scope, receive, watched if stream else send)

    app.add_middleware(Watch)
    s = serve_start(app)
    with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=60, json={
            "model": "sparkchat", "messages": HI, "max_tokens": 12, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert seen == ["http.response.start"], seen


def test_a_busy_engine_answers_with_its_next_step(server):
    """Requests sent while others decode: the engine reads them between steps and each acknowledgement
    comes in a step's message beside that step's tokens, never alone (fails with an immediate answer a
    command: one more message, and a wake-up on each side)."""
    link = server.app.state.runtime.link
    acks, on_message = [], link._on_message
    link._on_message = lambda step: (acks.extend(bool(step.ids) for _ in step.acks), on_message(step))[1]
    try:
        def one(i):
            with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
                    "model": "sparkchat", "messages": HI, "max_tokens": 48, "seed": i, "stream": True}) as r:
                return sse_events(r)

        first = threading.Thread(target=one, args=(0,))
        first.start()
        while not link.streams:  # the first request is in; the rest arrive while it decodes
            time.sleep(0.01)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(1, 7)]
        for t in threads:
            t.start()
        for t in [first, *threads]:
            t.join(60)
    finally:
        del link._on_message
    assert len(acks) == 7
    assert sum(acks) >= 6, acks  # the first may be answered by an idle engine, alone


def test_a_stream_that_fell_behind_gets_its_tokens_in_one_event(server):
    """The front end's loop stalls for a second while the engine goes on: the tokens of that second come
    as one event, not one each; the text is the same as the same seeded request's without the stall."""
    loop = server.app.state.runtime.link.loop
    body = {"model": "sparkchat", "messages": HI, "max_tokens": 100, "seed": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    texts = []
    for stall in (True, False):
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk: the request is in the engine
            if stall:
                loop.call_soon_threadsafe(time.sleep, 1.0)  # the loop falls behind
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        content = [e["choices"][0]["delta"]["content"] for e in events
                   if e["choices"] and e["choices"][0]["delta"].get("content")]
        assert events[-1]["usage"]["completion_tokens"] == 100
        texts.append(content)
    assert len(texts[0]) <= 10 < len(texts[1]), (len(texts[0]), len(texts[1]))
    assert "".join(texts[0]) == "".join(texts[1])


def test_stream_interval_spaces_the_events(serve_start, serve_model_dir):
    """With a 0.3 s interval, a reply of 60 tokens at 10 ms a step comes in a handful of events; the
    same seeded request without it (under the default events a second, as one stream) comes a token an
    event, with the same text."""
    paced = serve_start(in_process(serve_model_dir, delay=0.01, stream_interval=0.3))
    plain = serve_start(in_process(serve_model_dir, delay=0.01))
    body = {"model": "sparkchat", "messages": HI, "max_tokens": 60, "seed": 5, "stream": True}
    texts, took = [], []
    for srv in (paced, plain):
        t = time.monotonic()
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
            content = [e["choices"][0]["delta"]["content"] for e in sse_events(r)
                       if e["choices"] and e["choices"][0]["delta"].get("content")]
        took.append(time.monotonic() - t)
        texts.append(content)
    # 0.6 s of steps or more (however long a loaded machine made it take): at most one event per 0.3 s
    assert len(texts[0]) <= took[0] / 0.3 + 2, (len(texts[0]), took)
    assert len(texts[1]) > 15  # (a token that ends inside a UTF-8 character shows no text yet)
    assert "".join(texts[0]) == "".join(texts[1])


def test_a_spaced_stream_wakes_its_reader_only_when_due():
    """A stream spaced by the events budget (`next_at`) keeps the tokens of earlier engine steps without
    waking its reader; the first step at its time (a millisecond of uvloop's clock early included), or
    its end, wakes it. No timer is set: a running stream gets a token every step."""
    uvloop = pytest.importorskip("uvloop")

    async def main():
        loop = asyncio.get_running_loop()
        stream = types.SimpleNamespace(pending=[], next_at=loop.time() + 5, wake=Wake(), loop=loop)
        stream.due = lambda now: TextStream.due(stream, now)
        end = Finished("stop", 3, 2)
        for ev, at, woken in [(7, stream.next_at - 1, False),  # a step before its time
                              (8, stream.next_at - 0.0005, True),  # the clock read just early
                              (end, stream.next_at - 1, True)]:  # its end
            waiting = asyncio.ensure_future(stream.wake.wait())
            await asyncio.sleep(0)
            TextStream.push(stream, ev, at)
            await asyncio.sleep(0)
            assert waiting.done() == woken, ev
            waiting.cancel()
        assert stream.pending == [7, 8, end]

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_events_a_second_space_the_events_of_many_streams(serve_start, serve_model_dir):
    """Eight choices streamed at 10 ms a step under a budget of 40 events a second: each choice's events
    come 8 / 40 = 0.2 s apart, a few tokens each, with the same text as without a budget (the reader is
    woken by a timer while tokens keep arriving: uvloop's timer handles once broke that)."""
    budget = serve_start(in_process(serve_model_dir, delay=0.01, events_per_s=40))
    free = serve_start(in_process(serve_model_dir, delay=0.01, events_per_s=0))
    body = {"model": "sparkchat", "messages": HI, "max_tokens": 60, "seed": 3, "n": 8, "stream": True}
    texts, counts, took = [], [], []
    for srv in (budget, free):
        content: dict[int, list[str]] = {}
        t = time.monotonic()
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for e in sse_events(r):
                for c in e["choices"]:
                    if c["delta"].get("content"):
                        content.setdefault(c["index"], []).append(c["delta"]["content"])
        took.append(time.monotonic() - t)
        texts.append({i: "".join(p) for i, p in content.items()})
        counts.append(max(len(p) for p in content.values()))
    assert texts[0] == texts[1] and len(texts[0]) == 8
    # at most one event a choice per 0.2 s of the reply (however long a loaded machine made it take),
    # and fewer than without the budget
    assert counts[0] <= took[0] / 0.2 + 2 and counts[0] < counts[1], (counts, took)


def test_a_paced_front_end_gets_a_message_a_few_times_a_spacing_not_each_step(serve_model_dir):
    """Eight generations at 10 ms a step for a front end whose pace (4 events a second) spaces each of
    its streams' events 8 / 4 = 2 s apart: the engine sends it a message at most every quarter of that
    (0.5 s), holding the tokens in between, answers a stats command at once all the same, and sends what
    it held once idle; every token arrives (fails with a message each step, with a held answer, or with
    events left behind). Without a pace, a message each step."""
    import multiprocessing

    from model.requests import SamplingParams
    from serve import engine_proc
    engine, info = engine_proc.load_engine(serve_model_dir, "cpu", 8, 8)
    engine.model = SlowModel(engine.model, 0.01)
    host = engine_proc.EngineHost(engine, info)
    hold = wire.PACE_SHARE * wire.spacing(8, 0.0, 4.0)

    def run(pace: bool):
        ours, theirs = multiprocessing.Pipe()
        host.add(theirs)
        assert type(ours.recv()) is wire.Hello
        if pace:
            ours.send(wire.Pace(0.0, 4.0))
        ours.send(wire.Submit([(rid, [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=60)) for rid in range(8)]))
        messages, times, asked_at = [], [], None
        while sum(len(m.finished) for m in messages) < 8:
            assert ours.poll(30), "the engine sent nothing more"
            messages.append(ours.recv())
            times.append(time.monotonic())
            if pace and asked_at is None:  # asked once the first message is in
                asked_at = time.monotonic()
                ours.send(wire.Stats(-1))
        tokens = sum(len(m.ids) for m in messages)
        # every token the engine counted arrived (a sampled stop id may end a generation before 60)
        assert tokens == sum(f[3] for m in messages for f in m.finished) > 8 * 30
        return messages, times, asked_at

    try:
        every_step, _, _ = run(pace=False)
        paced, times, asked_at = run(pace=True)
    finally:
        engine.shutdown()
    assert len(every_step) >= 50, len(every_step)  # (about a message a step)
    stats_at = next((i for i, m in enumerate(paced) if m.stats), None)
    assert stats_at is not None, "the stats command was never answered"
    assert times[stats_at] - asked_at < hold / 2, times[stats_at] - asked_at
    gaps = [b - a for a, b in zip(times, times[1:-1])]  # the last, sent when the engine went idle, may come sooner
    # (measured where they arrive: a late delivery shortens the gap after it; a message a step is 0.01 s)
    assert all(g >= hold / 2 for i, g in enumerate(gaps) if i + 1 != stats_at), (gaps, stats_at)
    assert len(paced) <= len(every_step) / 3, (len(paced), len(every_step))


def test_four_1mb_prompts_are_refused_without_being_tokenized(serve_start, serve_model_dir):
    """Four 1 MB prompts arriving while a stream runs are each refused as too long without being tokenized
    (before, the loop tokenized them whole), and answered while the stream still runs. That the stream
    meanwhile keeps getting tokens is timed against the real server's processes, apart from pytest's
    (tests/test_serve_procs.py)."""
    srv = serve_start(in_process(serve_model_dir, delay=0.02))
    tok = srv.app.state.runtime.tokenizer
    encoded, encode = [], tok.encode
    tok.encode = lambda text: (encoded.append(len(text)), encode(text))[1]
    statuses, answered, arrivals = [], [], []

    def flood():
        statuses.extend(post_large_prompts(srv.url))
        answered.append(time.monotonic())

    flooder = threading.Thread(target=flood)
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "sparkchat", "messages": HI, "max_tokens": 200, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
                if len(arrivals) == 2:  # the stream is under way (about 120 tokens, 20 ms each, to come)
                    flooder.start()
    assert len(arrivals) >= 2, f"the stream sent {len(arrivals)} text events: nothing to flood beside"
    flooder.join(60)
    assert statuses == ["context_length_exceeded"] * 4
    assert max(encoded, default=0) < 100_000  # no prompt was tokenized whole
    assert answered and answered[0] < arrivals[-1], "the large prompts were not answered during the stream"


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def test_a_large_body_is_decoded_and_validated_off_the_loop(server, monkeypatch):
    """A body over serve.bodies.INLINE_BYTES is decoded (json.loads) and validated (pydantic, which runs
    the schemas' whole_text on each field) on the body thread, where no event loop runs; a small one on
    the loop. Spies on both record which; before, FastAPI did both on the loop for every body."""
    from serve import schemas
    from serve.bodies import INLINE_BYTES
    decoded, validated = [], []
    loads, whole_text = json.loads, schemas.whole_text

    def loads_spy(s, *args, **kwargs):
        if isinstance(s, (bytes, str)) and '"prompt"' in (s if isinstance(s, str) else s.decode(errors="replace")):
            decoded.append((len(s), _on_loop()))
        return loads(s, *args, **kwargs)

    def whole_text_spy(value):
        if isinstance(value, list) and len(value) > 1:
            validated.append((len(value), _on_loop()))
        return whole_text(value)

    monkeypatch.setattr(json, "loads", loads_spy)
    monkeypatch.setattr(schemas, "whole_text", whole_text_spy)
    large, small = list(range(1, 30_001)), [1, 2, 3]
    for prompt in (large, small):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "sparkchat", "prompt": prompt, "max_tokens": 1})
        assert r.status_code in (200, 400), r.text  # (30,000 ids exceed the context: a 400 after validation)
    assert len(json.dumps({"prompt": large})) > INLINE_BYTES
    assert decoded and all(not on for n, on in decoded if n > INLINE_BYTES), decoded
    assert [on for n, on in validated if n == len(large)] == [False], validated
    assert [on for n, on in decoded if n < INLINE_BYTES] == [True] and [on for n, on in validated if n == 3] == [True]


def test_a_failed_generation_is_an_error_not_a_quiet_stop(serve_start, serve_model_dir):
    srv = serve_start(broken_app(serve_model_dir))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="sparkchat", messages=HI, max_tokens=4)
    assert e.value.response.json()["error"]["code"] == "engine_error"
    with pytest.raises(openai.APIError, match="failed while generating"):
        list(client.chat.completions.create(model="sparkchat", messages=HI, max_tokens=4, stream=True))
    with pytest.raises(openai.APIError, match="failed while generating"):
        list(client.completions.create(model="sparkchat", prompt="Hi", max_tokens=4, stream=True))


def test_the_last_event_goes_out_with_the_end_of_the_body():
    """Each event is a write: a response's closing events (`Last`) go out with the body's end, not as
    one more write; an iterator without a `Last` still ends the body. The events come from a task of
    the response's own."""
    from serve.sse import EventStream, Last

    async def main(events):
        sent = []

        async def send(message):
            sent.append((message["type"], message.get("body"), message.get("more_body")))

        async def receive():
            await asyncio.sleep(60)

        async def gen():
            for e in events:
                yield e

        await EventStream(gen())({"type": "http"}, receive, send)
        return sent[1:]

    assert asyncio.run(main(["data: 1\n\n", Last("data: 2\n\ndata: [DONE]\n\n")])) == [
        ("http.response.body", b"data: 1\n\n", True), ("http.response.body", b"data: 2\n\ndata: [DONE]\n\n", False)]
    assert asyncio.run(main(["data: 1\n\n"])) == [("http.response.body", b"data: 1\n\n", True),
                                                  ("http.response.body", b"", False)]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "Hi"}), ("/v1/responses", {"input": "Hi"})],
    ids=["chat", "completions", "responses"])
def test_a_stream_whose_client_leaves_before_its_first_event_is_cancelled(serve_start, serve_model_dir, path, body):
    """The response's start waits (uvicorn drains a socket the client does not read) and the client goes
    away: the engine requests opened for it are cancelled, though its events never began (their own
    `finally` never ran: they decoded on to max_tokens for no one)."""
    s = serve_start(in_process(serve_model_dir, delay=0.05))  # 100 tokens: 5 s if not cancelled
    rt = s.app.state.runtime
    data = json.dumps({"model": "sparkchat", "stream": True, **body,
                       "max_tokens" if path != "/v1/responses" else "max_output_tokens": 100}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(data)).encode())],
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5555)}

    async def request() -> int:
        started, asked, status = asyncio.Event(), [], []

        async def receive():
            asked.append(1)
            if len(asked) == 1:
                return {"type": "http.request", "body": data, "more_body": False}
            await started.wait()  # the client leaves while the start waits
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                started.set()
                if message["status"] == 200:
                    await asyncio.sleep(60)

        await asyncio.wait_for(s.app(scope, receive, send), 30)
        return status[0]

    cancels, real_cancel = [], rt.engine.cancel
    rt.engine.cancel = lambda req: (cancels.append(not req.done), real_cancel(req))[1]
    try:  # on the server's loop, where the runtime's link lives
        assert asyncio.run_coroutine_threadsafe(request(), rt.link.loop).result(60) == 200
        deadline = time.time() + 30
        while rt.engine.num_active and time.time() < deadline:
            time.sleep(0.01)
    finally:
        del rt.engine.cancel
    assert any(cancels), "the request was not cancelled: it ran to its end"
    assert rt.engine.num_active == 0


def test_a_front_end_that_leaves_too_much_unread_is_dropped(serve_model_dir, monkeypatch):
    """A front end that reads nothing while its requests' events pile up past MAX_BACKLOG (made small
    here, with small socket buffers): the engine drops it (its requests cancelled) without ever waiting on
    it, and serves the next front end."""
    import multiprocessing
    import socket

    from model.requests import SamplingParams
    from serve import engine_proc
    monkeypatch.setattr(wire, "MAX_BACKLOG", 8 * 1024)
    engine, info = engine_proc.load_engine(serve_model_dir, "cpu", 4, 8)
    host = engine_proc.EngineHost(engine, info)
    try:
        ours, theirs = multiprocessing.Pipe()
        host.add(theirs)
        ours.recv()  # the hello; nothing after it is read
        for conn, opt in ((theirs, socket.SO_SNDBUF), (ours, socket.SO_RCVBUF)):
            with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:  # (the same socket)
                s.setsockopt(socket.SOL_SOCKET, opt, 4096)
        many = SamplingParams(temperature=1.0, max_tokens=100, logprobs=20)
        ours.send(wire.Submit([(rid, [1, 2, 3], many) for rid in range(8)]))
        deadline = time.time() + 30
        while host.peers and time.time() < deadline:
            time.sleep(0.05)
        assert not host.peers, "the front end that read nothing was not dropped"
        while (engine.num_active or engine.queue_depth) and time.time() < deadline:
            time.sleep(0.05)
        assert engine.num_active == 0 and engine.queue_depth == 0  # its requests were cancelled

        ours2, theirs2 = multiprocessing.Pipe()
        host.add(theirs2)
        assert type(ours2.recv()) is wire.Hello
        ours2.send(wire.Submit([(0, [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=5))]))
        steps = []
        while not any(m.finished for m in steps):
            assert ours2.poll(30), "the next front end got no events"
            steps.append(ours2.recv())
        assert sum(len(m.ids) for m in steps) == next(f for m in steps for f in m.finished)[3]
    finally:
        engine.shutdown()
