"""`sparkchat serve` against hostile and broken clients (serve/limits.py, serve/watchdog.py): real
processes, raw sockets.

A 64 MB header and 10,000 headers are refused after the head's limit, and /health answers meanwhile;
1,100 slow clients under `ulimit -n 1024` get closed, and every probe meanwhile is answered (a 503 with
Retry-After at worst); a SIGSTOPped engine turns /health 503 and fails requests instead of leaving them
waiting; a front end killed five times while serving is started again each time; a half-closed client
keeps its stream; a clean stop logs no ERROR; folders of a supervisor killed with -9 are removed.
"""
from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_serve_procs import Server, Stream, banned  # noqa: F401  (banned: a fixture)


def health_statuses(url: str, stop: threading.Event, out: list) -> None:
    """GET /health until `stop`: the status, or the error's name, of each."""
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            try:
                out.append(client.get(url + "/health").status_code)
            except httpx.HTTPError as e:
                out.append(type(e).__name__)
            time.sleep(0.05)


def raw_request(port: int, head: bytes, chunk: int = 1 << 16) -> tuple[str, int]:
    """Send `head` (a request without a body) in chunks; (the response's status line, or the error that
    ended the send, and the bytes sent)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        try:
            while sent < len(head):
                sent += s.send(head[sent:sent + chunk])
        except OSError as e:
            return type(e).__name__, sent
        try:
            return s.makefile("rb").readline().decode().strip(), sent
        except OSError as e:
            return type(e).__name__, sent


def test_a_64mb_header_is_refused_early_and_health_answers_meanwhile(long_model_dir):
    """How long /health waits under it is bench/api_attacks.py's to measure (header_64mb), not a test's."""
    server = Server(long_model_dir, "--no-ui")
    stop, statuses = threading.Event(), []
    try:
        server.wait_healthy()
        prober = threading.Thread(target=health_statuses, args=(server.url, stop, statuses))
        prober.start()
        time.sleep(0.3)
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 20) + b"\r\n\r\n"
        status, sent = raw_request(server.port, head)
        time.sleep(0.3)
        stop.set()
        prober.join(30)
        # refused (the 431, or the connection closed under the sender) long before all of it was read
        assert status.startswith("HTTP/1.1 431") or status in ("ConnectionResetError", "BrokenPipeError"), status
        assert status != "HTTP/1.1 200 OK"
        assert statuses and all(s == 200 for s in statuses), statuses
        r = httpx.get(server.url + "/health", headers={"X-Big": "a" * 10_000}, timeout=10)
        assert r.status_code == 431 and "--max-header-bytes" in r.json()["error"]["message"]
        assert "refused with 431" in server.log_text()
    finally:
        stop.set()
        assert server.stop() == 0


def test_ten_thousand_headers_are_refused(long_model_dir):
    server = Server(long_model_dir, "--no-ui")
    try:
        server.wait_healthy()
        head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(10_000)) + b"\r\n"
        status, _ = raw_request(server.port, head)
        assert status.startswith("HTTP/1.1 431") or status in ("ConnectionResetError", "BrokenPipeError"), status
        r = httpx.get(server.url + "/health", headers={f"X-{i}": "1" for i in range(101)}, timeout=10)
        assert r.status_code == 431 and "over 100 headers" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/health", headers={f"X-{i}": "1" for i in range(90)}).status_code == 200
    finally:
        assert server.stop() == 0


def _low_fd_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def test_slow_clients_are_closed_and_probes_answered_under_a_low_fd_limit(long_model_dir):
    """1,100 connections that send nothing, or half a head, to a server under `ulimit -n 1024`: the front
    end holds what its descriptors allow, answers the rest 503 with Retry-After, closes the idle ones
    after the keep-alive timeout and the half-sent ones after the request timeout (408), and every
    /health probe meanwhile gets an answer. (Before: all stayed open, and probes failed unanswered.)"""
    from serve.limits import FD_RESERVE, LINGER_S, REFUSE_WITHIN_S, REFUSING
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4096:
        pytest.skip("this test's own process needs over 2,200 descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    port = __import__("test_serve_procs").free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "serve", "--model", str(long_model_dir), "--port", str(port),
                             "--device", "cpu", "--no-ui", "--keep-alive-timeout", "2", "--request-timeout", "3"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_low_fd_limit)
    url = f"http://127.0.0.1:{port}"
    slow: list[socket.socket] = []
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        for i in range(1100):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            if i % 2:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and nothing more
            slow.append(s)
        # (a connection that comes while the burst's refusals still use the spare descriptors is closed
        # unanswered: serve.limits.REFUSING)
        time.sleep(REFUSE_WITHIN_S + LINGER_S + 0.2)
        answers = []
        for _ in range(10):  # while the slow ones hold the front end
            time.sleep(0.1)
            try:
                r = httpx.get(url + "/health", timeout=10)
                answers.append((r.status_code, r.headers.get("retry-after")))
            except httpx.HTTPError as e:
                answers.append((type(e).__name__, None))
        assert all(a in ((200, None), (503, "1")) for a in answers), answers
        closed, t0 = 0, time.monotonic()
        for s in slow:  # each is closed by the server: its end, or a refusal
            s.settimeout(max(0.1, 20 - (time.monotonic() - t0)))
            try:
                data = s.recv(4096)
                closed += data == b"" or data.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503"))
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass
        assert closed == 1100
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        log.seek(0)
        text = log.read().decode(errors="replace")
        assert "this front end's limit (--max-connections)" in text
        assert f"at most {1024 - FD_RESERVE - REFUSING} connections" in text
    finally:
        for s in slow:
            s.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_stopped_engine_is_seen(long_model_dir, banned):  # noqa: F811
    """The engine process SIGSTOPped while a stream runs: within a few seconds /health says 503 and why, a
    new request fails with 503 instead of waiting, the stream ends with an error event, and the server
    stops with code 1 (the engine's state cannot be trusted; a process manager restarts it)."""
    server = Server(long_model_dir, "--no-ui", "--engine-timeout", "1")
    try:
        server.wait_healthy()
        stream = Stream(server.port, banned)
        stream.read(3)
        engine = server.engine()[0]
        os.kill(engine, signal.SIGSTOP)
        t0 = time.monotonic()
        deadline, health = t0 + 10, None
        while time.monotonic() < deadline:
            health = httpx.get(server.url + "/health", timeout=10)
            if health.status_code == 503:
                break
            time.sleep(0.1)
        assert health.status_code == 503 and "has not answered" in health.json()["error"], health.text
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"model": "sparkchat", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled", r.text
        stream.read()
        assert stream.events[-1]["error"]["code"] == "engine_error"
        assert server.proc.wait(30) == 1
        assert "stopping the server" in server.log_text()
    finally:
        try:
            os.kill(engine, signal.SIGCONT)
        except (ProcessLookupError, UnboundLocalError):
            pass
        server.stop()


def test_a_front_end_killed_five_times_while_serving_keeps_the_server(long_model_dir):
    """An OOM killer under load takes the front end again and again: each time it had served, so it is
    started again at once, and the server stays up (the start-failure limit counted these too)."""
    from serve.supervisor import QUICK_EXITS
    server = Server(long_model_dir, "--no-ui", "--api-servers", "1")
    try:
        for _ in range(QUICK_EXITS):
            server.wait_healthy()
            assert httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "sparkchat", "prompt": "Hi", "max_tokens": 2}).status_code == 200
            victim = next(p for p in server.children() if _serves(server, p))
            os.kill(victim, signal.SIGKILL)
            deadline = time.time() + 30
            while victim in server.children() and time.time() < deadline:
                time.sleep(0.1)
        server.wait_healthy()
        assert server.proc.poll() is None
        assert server.log_text().count("its connections are lost; starting it again\n") == QUICK_EXITS
    finally:
        assert server.stop() == 0


def _serves(server: Server, pid: int) -> bool:
    """Whether process `pid` holds a listening copy of the server's port."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == server.port and f[3] == "0A":  # LISTEN
            inodes.add(f"socket:[{f[9]}]")
    try:
        return bool(inodes & {os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()})
    except OSError:
        return False


def test_a_half_closed_client_keeps_its_stream(long_model_dir, banned):  # noqa: F811
    server = Server(long_model_dir, "--no-ui")
    try:
        server.wait_healthy()
        stream = Stream(server.port, banned, max_tokens=200)
        stream.sock.shutdown(socket.SHUT_WR)  # the request is sent: nothing more will come
        stream.read()
        assert stream.done and stream.events[-1]["usage"]["completion_tokens"] == 200
    finally:
        assert server.stop() == 0


def test_a_clean_stop_logs_no_error_and_stale_folders_are_removed(long_model_dir):
    """SIGTERM to the whole process group, as a service manager stops it: exit code 0 and no ERROR line. A
    supervisor killed with -9 leaves its folders (engine socket, metrics) in the temp directory: the next
    server's start removes them."""
    temp = tempfile.mkdtemp()
    env_temp = {"TMPDIR": temp}
    first = Server(long_model_dir, "--no-ui", env=env_temp)
    try:
        first.wait_healthy()
        assert len(list(Path(temp).glob("sparkchat-*"))) == 2  # its engine's socket folder, its metrics'
        first.proc.kill()
        first.proc.wait(10)
        deadline = time.time() + 30
        while first.children() and time.time() < deadline:  # its children notice, and leave
            time.sleep(0.2)
    finally:
        first.stop()
    left = sorted(p.name for p in Path(temp).glob("sparkchat-*"))
    assert len(left) == 2
    second = Server(long_model_dir, "--no-ui", env=env_temp)
    try:
        second.wait_healthy()
        now = sorted(p.name for p in Path(temp).glob("sparkchat-*"))
        assert not set(left) & set(now) and len(now) == 2
        os.killpg(second.proc.pid, signal.SIGTERM)
    finally:
        assert second.stop() == 0
    assert " ERROR " not in second.log_text(), second.log_text()[-3000:]
    assert list(Path(temp).glob("sparkchat-*")) == []


def test_malformed_chat_page_calls_are_refused_with_a_4xx(serve_model_dir, caplog):
    """Logged-in calls to the chat page's own API that Gradio fails on (data not of the endpoint's shape or
    count, unknown endpoints and function indexes): a 4xx naming the call, no 500, no ERROR logged. Too
    few or too many values in `data` are refused before Gradio runs the call (it failed on too few with a
    500 and a traceback, or after a 200 in the event stream), and an unknown event or session is a 404
    (it was a 200 and an error event); without the login, Gradio's 401 comes first."""
    from fastapi.testclient import TestClient

    from serve.api import Settings, create_app
    from serve.runtime import Runtime
    app = create_app(Settings(model_dir=serve_model_dir, api_key="key", ui=True),
                     loader=lambda metrics: Runtime.in_process(serve_model_dir, metrics, "cpu"))
    calls = [("/gradio_api/call/v2/respond", {"data": 5}), ("/gradio_api/call/v2/respond", {"data": "x"}),
             ("/gradio_api/call/v2/nosuch", {"message": "hi"}), ("/gradio_api/call/nosuch", {"data": []}),
             ("/gradio_api/queue/join", {"data": [], "fn_index": 999, "session_hash": "abc"}),
             ("/gradio_api/run/nosuch", {"data": []})]
    miscounted = [("/gradio_api/call/respond", {"data": []}), ("/gradio_api/call/respond", {"data": list(range(1, 10))}),
                  ("/gradio_api/run/respond", {"data": []}), ("/gradio_api/api/respond", {"data": ["hi"]})]
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/gradio_api/call/respond", json={"data": []}).status_code == 401
        assert client.post("/login", data={"username": "u", "password": "key"}).status_code == 200
        respond = next(d for d in client.get("/config").json()["dependencies"] if d["api_name"] == "respond")
        miscounted.append(("/gradio_api/queue/join", {"data": [], "fn_index": respond["id"], "session_hash": "abc"}))
        for path, body in calls + miscounted:
            r = client.post(path, json=body)
            assert 400 <= r.status_code < 500 and path in r.json()["error"]["message"], (path, r.status_code, r.text)
        for path, body in miscounted:
            r = client.post(path, json=body)
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and f"`data` holds {len(body['data'])} value" in message, r.text
            assert "respond takes " in message and message.endswith(str(len(respond["inputs"]))), message
        for path in ("/gradio_api/call/respond/nosuch", "/gradio_api/queue/data?session_hash=nosuch"):
            r = client.get(path)
            assert r.status_code == 404 and "unknown " in r.json()["error"]["message"], (path, r.text)
        event = client.post("/gradio_api/call/v2/respond", json={"message": "Hi"}).json()["event_id"]
        with client.stream("GET", f"/gradio_api/call/respond/{event}") as r:  # a known one streams
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"]
