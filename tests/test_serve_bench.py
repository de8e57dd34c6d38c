"""The serving benchmark's text model and its CPU accounting (bench/text_model.py, bench/serve_gpu.py).

No timing here: the benchmark measures speed, these check that what it counts is what it says.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve import content_events, text_tokens_of
from bench.serve_gpu import ENGINE_PROCESS_CPU, STEP_CPU, server_cpu, tree_cpu
from bench.text_model import text_tokenizer, text_tokens

ROOT = Path(__file__).resolve().parent.parent
from model.tokenizer import StreamDecoder


@pytest.fixture(scope="module")
def tok():
    return text_tokenizer(2048)


def test_the_benchmark_tokenizer_gives_every_id_of_the_model_text(tok):
    """A random model samples any id: each must stand for bytes, and a control id aside, decode to text
    on its own (a lone non-ASCII byte as U+FFFD) and within a stream of random ids."""
    assert tok.vocab_size == 2048  # exactly the model's vocabulary
    special = set(tok.special.values())
    for i in range(tok.vocab_size):
        assert tok.token_bytes(i), i
        if i not in special:
            assert tok.decode([i]), i
    ids = [i for i in range(tok.vocab_size) if i not in special]
    random.Random(0).shuffle(ids)
    decoder = StreamDecoder(tok)
    shown = "".join(decoder.push(i) for i in ids) + decoder.flush()
    # no id's bytes were lost: each came out as itself or inside a U+FFFD (3 bytes for at most 3 of them)
    assert len(shown.encode()) >= sum(len(tok.token_bytes(i)) for i in ids)


def test_text_tokens_counts_the_ids_of_one_token_events(tok):
    """The client counts text tokens from events, without ids: exact to 1% at one token an event (the
    current server), a control id or a dropped event counted as missing."""
    special = set(tok.special.values())
    ids_ok = [i for i in range(tok.vocab_size) if i not in special]
    rng = random.Random(1)
    total = counted = 0
    for _ in range(50):
        ids = [rng.choice(ids_ok) for _ in range(64)]
        decoder = StreamDecoder(tok)
        events = [decoder.push(i) for i in ids] + [decoder.flush()]
        total += len(ids)
        counted += sum(text_tokens(tok, e) for e in events if e)
    assert abs(counted / total - 1) < 0.01
    assert text_tokens(tok, "") == 0 and text_tokens(tok, "\ufffd\ufffd") == 2


def _response(contents: list[str], completion_tokens: int | None) -> list[str]:
    chunks = [{"choices": [{"delta": {"role": "assistant"}}]}]
    chunks += [{"choices": [{"delta": {"content": c}}]} for c in contents]
    chunks.append({"choices": [], "usage": {"completion_tokens": completion_tokens}} if completion_tokens is not None
                  else {"choices": []})
    return ["data: " + json.dumps(c) for c in chunks]


def test_text_tokens_of_streamed_responses_is_capped_by_their_usage(tok):
    word = tok.decode([tok.encode(" the")[0]])
    assert text_tokens_of(tok, [_response([word, word], 5)]) == 2  # 3 tokens sent no text
    assert text_tokens_of(tok, [_response([word] * 4, 3)]) == 3  # never more than were generated
    assert text_tokens_of(tok, [_response([word], 1), _response([], 2)]) == 1
    with pytest.raises(RuntimeError, match="usage chunk"):
        text_tokens_of(tok, [_response([word], None)])


def test_content_events_count_the_events_that_carry_text(tok):
    word = tok.decode([tok.encode(" the")[0]])
    # the role chunk, an empty content and the usage chunk carry no text
    assert content_events([_response([word, "", word], 5), _response([word], 1), _response([], 0)]) == 3


def test_server_cpu_is_the_process_tree_less_the_engine_step_counter():
    before = {"tree": {(10, 1.0): 5.0, (11, 2.0): 1.0}, "metrics": {STEP_CPU: 100.0}}
    # process 11 used 0.5 s, 10 used 2.5 s, 12 started within the window and used 0.25 s
    after = {"tree": {(10, 1.0): 7.5, (11, 2.0): 1.5, (12, 3.0): 0.25}, "metrics": {STEP_CPU: 101.75}}
    got = server_cpu(before, after)
    assert got["tree_cpu_s"] == pytest.approx(3.25)
    assert got["engine_step_cpu_s"] == pytest.approx(1.75)
    assert got["server_cpu_s"] == pytest.approx(1.5)
    assert "frontend_cpu_s" not in got  # no engine-process counter: no split
    # with the engine process's CPU (2.0 s of it, 1.75 in steps): the rest of the tree is the front ends'
    got = server_cpu({**before, "metrics": {STEP_CPU: 100.0, ENGINE_PROCESS_CPU: 50.0}},
                     {**after, "metrics": {STEP_CPU: 101.75, ENGINE_PROCESS_CPU: 52.0}})
    assert got["engine_host_cpu_s"] == pytest.approx(0.25) and got["frontend_cpu_s"] == pytest.approx(1.25)
    assert got["engine_host_cpu_s"] + got["frontend_cpu_s"] == pytest.approx(got["server_cpu_s"])
    # a server without the counter: nothing is subtracted, and no figure claims it was
    got = server_cpu({**before, "metrics": {}}, {**after, "metrics": {}})
    assert got == {"tree_cpu_s": pytest.approx(3.25), "engine_step_cpu_s": None, "server_cpu_s": None}


def test_tree_cpu_counts_a_child_process():
    burn = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\n"
            "print('ok', flush=True)\nsys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ok\n"
        cpu = tree_cpu(os.getpid())
        mine = [v for (pid, _), v in cpu.items() if pid == child.pid]
        assert mine and mine[0] >= 0.2
    finally:
        child.stdin.close()
        child.wait(10)


def test_the_event_floor_counts_every_token_its_bare_app_sent(tmp_path):
    """bench/sse_floor.py: at 2 tokens an event, 4 streams of 6 tokens each, every token is counted and
    the server's CPU a token is a positive figure with its rounds' range. The CPU is read in 10 ms clock
    ticks: a round of 1 s spends several of them (at 0.2 s one round read 0 ticks on CI)."""
    from bench.sse_floor import main
    out = tmp_path / "floor.json"
    res = main(["--streams", "4", "--tokens-per-event", "2", "--new", "6", "--rounds", "2", "--seconds", "1",
                "--tick", "0.005", "--out", str(out)])
    level = res["levels"][2]
    assert all(r["tokens"] % (4 * 6) == 0 and r["tokens"] > 0 for r in level["rounds"])
    s = level["server_cpu_us_per_token"]
    assert 0 < s["min"] <= s["median"] <= s["max"] and s["n"] == 2
    assert json.loads(out.read_text())["levels"]["2"]["rounds"] == level["rounds"]


def test_a_frozen_heap_leaves_full_collections_little_to_walk(tmp_path, serve_model_dir):
    """bench/gc_pause.py: a front end's and an engine process's heaps, built as the server builds them,
    hold many thousand tracked objects; after serve.processes.freeze_heap a full pass walks almost none,
    and takes less time than before."""
    from bench.gc_pause import main
    res = main(["--model", str(serve_model_dir), "--rounds", "2", "--out", str(tmp_path / "gc.json")])
    for kind in ("frontend", "engine"):
        r = res[kind]
        assert r["tracked_objects"] > 50_000 and r["left_after_freeze"] < 1_000
        assert r["frozen"]["max"] < r["unfrozen"]["min"] and r["unfrozen"]["n"] == 2
    assert json.loads((tmp_path / "gc.json").read_text())["engine"]["frozen_ms"] == res["engine"]["frozen_ms"]


def test_the_steady_reference_keeps_every_row_busy_with_streams_that_start_and_end_each_step():
    """bench.serve_gpu.steady_round: each stream is submitted again as it ends, the ends spread over a
    reply's length, so the batch stays full while streams come and go; every request it started ends."""
    import torch
    from bench.serve_gpu import steady_round
    from model.engine import Engine, EngineConfig
    from model.gpt import GPT, GPTConfig
    from model.requests import Finished, SamplingParams
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_embd=32, n_head=2, n_kv_head=2, seq_len=128)).eval()
    model.init_weights(seed=0)
    engine = Engine(model, EngineConfig(max_batch=8, cuda_graphs=False)).start()
    submitted, ended = [], []
    submit = engine.submit

    def counting_submit(prompt, params, sink):
        submitted.append(params.max_tokens)
        return submit(prompt, params, lambda ev: (ended.append(1) if isinstance(ev, Finished) else None, sink(ev)))

    engine.submit = counting_submit
    try:
        n, new = 8, 16
        r = steady_round(engine, [[1, 2, 3]] * n, [SamplingParams(max_tokens=new, seed=i) for i in range(n)], 0.3)
    finally:
        engine.shutdown()
    assert sorted(submitted[:n]) == [2, 4, 6, 8, 10, 12, 14, 16]  # the first ends spread over a reply
    assert submitted[n:] and set(submitted[n:]) == {new}  # then whole replies, again and again
    assert len(ended) == len(submitted)  # nothing left running
    assert r["tokens"] > 0 and n - 1 <= r["tokens_per_step"] <= n + 1  # rows left and filled between steps
    # its step phases, from the engine's counters: n / new requests end a step, each taken in before the next
    assert 0.25 <= r["admissions_per_step"] <= 1 and r["rows_per_admission"] >= 1
    assert r["decode_ms_per_step"] > r["wait_ms_per_step"] >= 0 and r["admit_ms_per_step"] > 0


# ---- the client-side benchmark (bench/serve_client.py), the transformers peer and bench/check_keys.py ----

def test_client_stats_from_request_records():
    """TTFT from the send to the first content chunk, ITL between chunks, tokens from usage: a request
    whose chunks never came counts its tokens but no latency."""
    from bench.serve_client import client_stats, percentile
    recs = [{"sent": 0.0, "chunks": [0.010, 0.012, 0.016], "end": 0.020, "tokens": 3},
            {"sent": 0.005, "chunks": [0.025, 0.026], "end": 0.030, "tokens": 4},
            {"sent": 0.010, "chunks": [], "end": 0.040, "tokens": 1}]
    s = client_stats(recs)
    assert s["requests"] == 3 and s["tokens"] == 8 and s["seconds"] == 0.04 and s["tokens_per_s"] == 200.0
    assert s["ttft_ms_p50"] == pytest.approx(15.0) and s["itl_ms_p50"] == pytest.approx(2.0)
    assert s["itl_ms_p99"] == pytest.approx(percentile([2.0, 4.0, 1.0], 99))
    assert s["tpot_ms_p50"] == pytest.approx((3.0 + 1.0 / 3) / 2, rel=1e-3)  # 6/2 and 1/3 ms: their median
    assert s["tokens_per_chunk"] == pytest.approx(8 / 5)
    assert percentile([], 50) is None and percentile([5.0], 99) == 5.0


def test_check_keys_names_what_is_missing_or_not_a_figure(tmp_path):
    from bench.check_keys import main as check
    from bench.stats import spread
    good = {"commit": "abc1234", "date": "2026-12-07T00:00:00Z", "floor_fraction": spread([0.5, 0.6, 0.7]),
            "deep": {"tokens_per_s_128": 100000.0, "x": [{"of_engine_64": 0.9}]}, "of_engine_128": spread([0.9]),
            "over_transformers": 3.1}
    f = tmp_path / "r.json"
    f.write_text(json.dumps(good))
    assert check([str(f)]) == 0
    # save_json's record of what ran is not a claim: its commit is None for a tree with changes
    f.write_text(json.dumps({"provenance": {"commit": None, "tree_hash": "f00"}, **good}))
    assert check([str(f)]) == 0
    bad = {**good, "over_transformers": True, "commit": ""}
    del bad["floor_fraction"]
    f.write_text(json.dumps(bad))
    assert check([str(f)]) == 1
    assert check([str(f), "tokens_per_s_128", "of_engine_64"]) == 0


def test_check_keys_over_several_files_every_value_and_per_variant_figures(tmp_path):
    """One key in one of the files is enough; every value stored under it must be a figure; a mapping of
    figures (one per precision) is one only where the caller says so (bench/vs_nanochat.py's `check`)."""
    from bench.check_keys import check_files, is_figure, problems
    s = {"median": 1.1, "min": 1.0, "max": 1.2, "n": 3}
    assert is_figure(s) and is_figure(2) and not is_figure(True) and not is_figure({"median": 1.0})
    assert not is_figure({"bf16": s}) and is_figure({"bf16": s, "fp8": 1.0}, per_variant=True)
    assert not is_figure({}, per_variant=True) and not is_figure({"bf16": "x"}, per_variant=True)
    assert problems([{"a": s}, {"b": 1}], ["a", "b"]) == [] and problems([{"a": s}], ["b"]) == ["b: missing"]
    assert problems([{"a": s}, {"x": {"a": "n/a"}}], ["a"]) == ["a: not a number or {median, min, max} ('n/a')"]
    assert problems([{"commit": "abc"}, {"commit": ""}], ["commit"]) == ["commit: not a non-empty string ('')"]
    (tmp_path / "one.json").write_text(json.dumps({"a": {"bf16": s}, "commit": "abc"}))
    (tmp_path / "two.json").write_text("{not json")
    one, two = str(tmp_path / "one.json"), str(tmp_path / "two.json")
    assert check_files([one], ["a", "commit"]) == 1 and check_files([one], ["a", "commit"], per_variant=True) == 0
    assert check_files([one, two], ["commit"]) == 1


@pytest.mark.slow
def test_client_benchmark_smoke_on_a_cpu(tmp_path, capsys):
    """bench/serve_client.py end to end at depth 2 on this CPU, one round, one stream, one Poisson rate,
    the transformers peer: its JSON carries the keys a CPU run measures; the floor needs a GPU."""
    from bench.check_keys import main as check
    out = tmp_path / "client.json"
    r = subprocess.run([sys.executable, "-m", "bench.serve_client", "--device", "cpu", "--depth", "2", "--levels", "1",
                        "--rates", "2", "--seconds", "1", "--rounds", "1", "--new", "8", "--peer", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["closed_loop"]["1"]["tokens_per_s"]["median"] > 0 and res["poisson"]["2"]["requests"]["median"] >= 0
    assert res["transformers"]["greedy_ids_equal_first_variant"]  # the same weights: the same greedy ids
    assert check([str(out), "tokens_per_s_1", "of_engine_1", "over_transformers", "commit", "date"]) == 0
    assert check([str(out), "floor_fraction"]) == 1
    assert "floor_fraction: missing" in capsys.readouterr().err
