"""/health's latency while hostile or broken clients hit the server, against an idle server's.

One `python -m serve` (its own processes, one front end, under `ulimit -n 1024` as many hosts start a
service), and for each attack (sent from a process of its own) a prober that GETs /health on a fresh
connection every 20 ms while the attack runs for `--seconds`: its p50 and p99 latency, and what it got
(200, a 503 with Retry-After, or no answer). The attacks are the ones issue 58 found holding the event loop or the descriptors:

    idle          nothing (the reference, measured in each round)
    header_64mb   GET /health with one 64 MB header, again and again
    headers_10k   requests of 10,000 headers, again and again
    slow_1100     1,100 connections that send nothing or half a head, held open
    ids_300k      four /v1/completions prompts of 300,000 token ids at once (0.9 MB each), again and again
    ids_300k_stream  the same beside a streamed completion, one after another: also the stream's longest
                  wait between two events
    turns_10k     a chat of 10,000 turns, again and again
    bias_60k      a logit_bias of 60,000 entries, again and again

Each round runs every attack once, in this order; the figure is the median of `--rounds` rounds with
its range, and p99 / idle p99 within each round. `--against TREE` starts a second server from another
tree (a checkout of the code before a change) and attacks it right after this tree's in each round,
so both are measured under the same load; its figures go under `against`.

    python -m bench.api_attacks --random-init 4 --out bench/results/api-robustness/attacks.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.serve import free_port, random_model_dir  # noqa: E402
from bench.stats import fmt, ratios, save_json, spread  # noqa: E402
from sparkchat import paths  # noqa: E402

ATTACKS = ["idle", "header_64mb", "headers_10k", "slow_1100", "ids_300k", "ids_300k_stream", "turns_10k",
           "bias_60k", "logprobs_n8"]
PROBE_EVERY_S = 0.02


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def start_server(model_dir: Path, log, tree: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """`python -m serve` of `tree`'s code."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("SPARKCHAT_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "serve", "--model", str(model_dir), "--port", str(port),
                             "--device", "cpu", "--no-ui", "--no-access-log"], cwd=tree, env=env, stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=_low_fd_limit, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    log.seek(0)
    sys.exit("the server did not start:\n" + log.read().decode(errors="replace")[-3000:])


def probe(url: str, stop: threading.Event, out: list) -> None:
    """GET /health on a fresh connection every PROBE_EVERY_S until `stop`: (seconds, what came back)."""
    while not stop.is_set():
        t = time.perf_counter()
        try:
            r = httpx.get(url + "/health", timeout=30)
            got = str(r.status_code) + ("+retry-after" if r.headers.get("retry-after") else "")
        except httpx.HTTPError as e:
            got = type(e).__name__
        out.append((time.perf_counter() - t, got))
        time.sleep(PROBE_EVERY_S)


def _send_head(port: int, head: bytes) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(head)
            s.recv(100)
    except OSError:
        pass  # refused mid-send: what the server should do


def _post(url: str, path: str, body: bytes) -> None:
    try:
        httpx.post(url + path, content=body, timeout=60, headers={"content-type": "application/json"})
    except httpx.HTTPError:
        pass


def stream(url: str, stop: threading.Event, gaps: list) -> None:
    """Streamed completions one after another until `stop`: the seconds between two events of a stream."""
    while not stop.is_set():
        last = None
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": "sparkchat", "prompt": "Once upon a time", "max_tokens": 100, "stream": True}) as r:
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if line.startswith("data: {"):
                        if last is not None:
                            gaps.append(now - last)
                        last = now
        except httpx.HTTPError:
            pass


def attack(name: str, url: str, stop, ready) -> None:
    """Run attack `name` against `url` until `stop` (set `ready` when it starts). In a process of its own,
    so that the attackers' work (sending 0.9 MB bodies from four threads) takes nothing of the probes'
    GIL: what they measure is the server."""
    port = int(url.rsplit(":", 1)[1])
    ready.set()
    if name == "idle":
        stop.wait()
    elif name == "header_64mb":
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 20) + b"\r\n\r\n"
        while not stop.is_set():
            _send_head(port, head)
    elif name == "headers_10k":
        head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(10_000)) + b"\r\n"
        while not stop.is_set():
            _send_head(port, head)
    elif name == "slow_1100":
        held = []
        for i in range(1100):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                if i % 2:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                held.append(s)
            except OSError:
                pass
        stop.wait()
        for s in held:
            s.close()
    else:
        name = name.removesuffix("_stream")  # (the stream runs beside the probes: `one`)
        path, body = {
            "ids_300k": ("/v1/completions", {"model": "sparkchat", "prompt": [1 + i % 9 for i in range(300_000)]}),
            "turns_10k": ("/v1/chat/completions", {"model": "sparkchat", "messages": [
                {"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(10_001)]}),
            "bias_60k": ("/v1/chat/completions", {"model": "sparkchat", "max_tokens": 1, "messages": [
                {"role": "user", "content": "hi"}], "logit_bias": {str(i): 1 for i in range(60_000)}}),
            # a reply of 8 choices x 128 tokens x 20 alternatives: 20k logprob entries to build and encode
            "logprobs_n8": ("/v1/chat/completions", {"model": "sparkchat", "n": 8, "max_tokens": 128, "logprobs": True,
                                                     "top_logprobs": 20, "messages": [{"role": "user", "content": "hi"}]}),
        }[name]
        senders, raw = 4 if name == "ids_300k" else 1, json.dumps(body).encode()

        def send():
            while not stop.is_set():
                _post(url, path, raw)

        threads = [threading.Thread(target=send) for _ in range(senders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def one(name: str, url: str, seconds: float) -> dict:
    spawn = multiprocessing.get_context("spawn")
    stop_attack, ready = spawn.Event(), spawn.Event()
    attacker = spawn.Process(target=attack, args=(name, url, stop_attack, ready))
    attacker.start()
    if not ready.wait(60):
        sys.exit(f"the attacker of {name} did not start")
    stop, samples, gaps = threading.Event(), [], []
    streamer = threading.Thread(target=stream, args=(url, stop, gaps)) if name.endswith("_stream") else None
    if streamer is not None:
        streamer.start()
    time.sleep(0.5 if name == "slow_1100" else 0.2)  # (the attack under way before the probes)
    prober = threading.Thread(target=probe, args=(url, stop, samples))
    prober.start()
    time.sleep(seconds)
    stop.set()
    stop_attack.set()
    for t in (prober, streamer):
        if t is not None:
            t.join()
    attacker.join(60)
    answered = [t for t, got in samples if got[0].isdigit()]
    outcomes: dict[str, int] = {}
    for _, got in samples:
        outcomes[got] = outcomes.get(got, 0) + 1
    return {"p50_s": percentile(answered, 0.5), "p99_s": percentile(answered, 0.99), "probes": len(samples),
            "outcomes": outcomes, **({"stream_gap_max_s": max(gaps), "stream_events": len(gaps)} if gaps else {})}


def summarise(rounds: list[dict], names: list[str], label: str = "") -> dict:
    """Each attack's p50 and p99 (ms), p99 over the idle p99 of the same round, and a stream's longest
    wait: the median of the rounds with its range."""
    summary = {}
    for name in names:
        p99 = [rd[name]["p99_s"] * 1e3 for rd in rounds]
        summary[name] = {"p99_ms": spread(p99), "p50_ms": spread([rd[name]["p50_s"] * 1e3 for rd in rounds]),
                         "p99_over_idle": spread(ratios(p99, [rd["idle"]["p99_s"] * 1e3 for rd in rounds]))
                         if "idle" in names else None}
        if all("stream_gap_max_s" in rd[name] for rd in rounds):
            summary[name]["stream_gap_max_ms"] = spread([rd[name]["stream_gap_max_s"] * 1e3 for rd in rounds])
        print(f"{label}{name:16s} p99 {fmt(summary[name]['p99_ms'], '.1f', ' ms')}"
              + (f"  x idle {fmt(summary[name]['p99_over_idle'], '.2f')}" if "idle" in names else "")
              + (f"  stream's longest wait {fmt(summary[name]['stream_gap_max_ms'], '.1f', ' ms')}"
                 if "stream_gap_max_ms" in summary[name] else ""))
    return summary


def tree_commit(tree: Path) -> str | None:
    """The commit `tree` is checked out at, when it is a git checkout (an exported tree: None)."""
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 and (tree / ".git").exists() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(paths.CHAT_MODEL), help="model directory (default: %(default)s)")
    ap.add_argument("--random-init", type=int, metavar="DEPTH", help="a random model of this depth instead")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="each attack's length (default: %(default)s)")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--against", type=Path, metavar="TREE", help="also attack a server of this tree's code, in turn")
    ap.add_argument("--against-commit", help="the commit TREE holds, for the raw file (a git checkout's is read)")
    ap.add_argument("--out", help="raw JSON here")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # (the slow clients' 1,100 descriptors)
    names = args.attacks.split(",")
    trees = {"this": ROOT, **({"against": args.against.resolve()} if args.against else {})}
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as log:
        model = random_model_dir(args.random_init, Path(tmp) / "model") if args.random_init else Path(args.model)
        servers = {side: start_server(model, log, tree) for side, tree in trees.items()}
        rounds: dict[str, list] = {side: [] for side in trees}
        try:
            for r in range(args.rounds):
                res: dict[str, dict] = {side: {} for side in trees}
                for name in names:
                    for side, (_, url) in servers.items():
                        got = res[side][name] = one(name, url, args.seconds)
                        time.sleep(4)  # the slow clients' and refusals' connections closed before the next
                        print(f"round {r + 1} {side:7s} {name:16s} p50 {got['p50_s'] * 1e3:8.1f} ms  p99 "
                              f"{got['p99_s'] * 1e3:8.1f} ms  {got['outcomes']}", flush=True)
                for side in trees:
                    rounds[side].append(res[side])
        finally:
            for proc, _ in servers.values():
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)
        summary = {side: summarise(rounds[side], names, f"{side:7s} ") for side in trees}
    out = {"command": "python -m bench.api_attacks " + " ".join(sys.argv[1:]), "model": str(args.model)
           if not args.random_init else f"random d{args.random_init}", "rounds": rounds["this"],
           "summary": summary["this"]}
    if args.against:
        out["against"] = {"tree": str(args.against), "commit": args.against_commit or tree_commit(trees["against"]),
                          "rounds": rounds["against"], "summary": summary["against"]}
    save_json(out, args.out)


if __name__ == "__main__":
    main()
