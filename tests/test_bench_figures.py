"""How the benchmarks compute the figures the results pages quote: medians and ranges (never a best of
N), ratios within a round, each child's own peak memory, and FSDP/DDP timed over the same steps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import data, fsdp, probe_spread
from bench.stats import own_peak_rss_mib, ratios, speedup, spread

ROOT = Path(__file__).resolve().parent.parent


def test_a_figure_is_the_median_with_its_range_not_the_best_round():
    assert spread([5.0, 1.0, 3.0, 9.0]) == {"median": 4.0, "min": 1.0, "max": 9.0, "n": 4}
    with pytest.raises(ValueError, match="no values"):
        spread([])


def test_a_speedup_of_unpaired_rounds_spans_every_pair():
    s = speedup([10.0, 12.0, 11.0], [5.0, 6.0, 5.5])  # reference ms, then the faster one's
    assert s["median"] == 2.0 and s["min"] == round(10 / 6, 4) and s["max"] == round(12 / 5, 4)
    with pytest.raises(ValueError, match="each round needs both sides"):
        ratios([1.0, 2.0], [1.0])


def own_peak(code: str) -> float:
    """Run `code` in a child of this (large: pytest, torch) process; the peak RSS the child reports."""
    report = "from bench.stats import own_peak_rss_mib; print(own_peak_rss_mib())"  # stdlib only: a small child
    out = subprocess.run([sys.executable, "-c", f"{code}\n{report}"], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return float(out.stdout.split()[-1])


def test_a_stages_peak_memory_is_its_own():
    """A stage reports its own peak: 300 MiB touched shows, and a small process started from this large
    one does not report this one's memory (getrusage's ru_maxrss there counts the parent's pages)."""
    assert own_peak("b = bytearray(300 << 20); b[::4096] = bytes(len(b[::4096]))") >= 300
    here = own_peak_rss_mib()
    assert here > 250, here  # the test's process holds torch: large enough that the next check tells
    assert own_peak("pass") < 150


def test_the_data_summary_compares_each_round_with_the_same_rounds_smaller_corpus():
    runs = []
    for r, (small, large, enc, tok) in enumerate([(100, 110, 10.0, 8.0), (200, 200, 12.0, 12.0), (100, 150, 9.0, 6.0)]):
        for size, rss in ((1, small), (4, large)):
            runs += [{"round": r, "size": size, "stage": st, "peak_rss_mib": rss} for st in data.STAGES]
        runs[-3].update(text_bytes=4e6)  # the large corpus's prepare reports its bytes
        runs[-1].update(seconds=tok)  # its tokenize
        runs += [{"round": r, "size": 4, "stage": "encode_batch", "seconds": enc},
                 {"round": r, "size": 4, "stage": "encode_batch_fast", "seconds": enc / 2},
                 {"round": r, "size": 4, "stage": "loader", "loader": [{"batch": 2, "seq_len": 8, "tokens_per_s": 5 + r}]}]
    s = data.summarise(runs, [1, 4])
    # per round 1.1, 1.0, 1.5: a ratio of medians (150 / 100) or of bests would differ
    assert s["peak_rss_vs_smallest"]["4"]["tokenize"] == {"median": 1.1, "min": 1.0, "max": 1.5, "n": 3}
    assert s["peak_rss_mib"]["4"]["prepare"]["median"] == 150
    # the stage against the raw encoder of the same round: 10/8, 12/12, 9/6
    assert s["tokenize_vs"]["encode_batch"] == {"median": 1.25, "min": 1.0, "max": 1.5, "n": 3}
    assert s["loader_tokens_per_s"]["2x8"] == {"median": 6, "min": 5, "max": 7, "n": 3}


def test_fsdp_rounds_cut_the_timed_steps_in_order():
    t = fsdp.timing([9.0, 9.0, 1.0, 1.0, 2.0, 2.0, 4.0, 9.0], warmup=2, timing_steps=5, rounds=3, tokens_per_step=10)
    assert t["timed_steps"] == [2, 7]
    assert t["round_tokens_per_s"] == [10.0, 5.0, 2.5]  # steps 2-3, 4-5, 6
    with pytest.raises(ValueError, match="timing needs 8"):
        fsdp.timing([1.0] * 7, warmup=3, timing_steps=5, rounds=1, tokens_per_step=1)


@pytest.mark.timeout(300)
def test_every_fsdp_mode_is_timed_over_the_same_steps(tmp_path):
    """DDP (speed only, fewer steps) and no wrapper (run on for the loss) time the same steps."""
    fsdp.main(["--device", "cpu", "--depth", "1", "--seq-len", "16", "--vocab", "128", "--batch", "2",
               "--steps", "9", "--warmup", "2", "--timing-steps", "4", "--rounds", "2", "--backends", "bf16",
               "--modes", "none", "ddp", "--compile", "off", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "fsdp.json").read_text())["results"]
    assert [(r["mode"], r["steps"]) for r in results] == [("none", 9), ("ddp", 6)], results
    for r in results:
        assert "error" not in r, r
        assert r["timed_steps"] == [2, 6]
        # the figure comes from exactly steps 2-5 of what ran
        assert r["tokens_per_s"] == fsdp.timing(r["step_s_all"], 2, 4, 2, 2 * 16)["tokens_per_s"]


def probe(device, rows):
    return {"device": device, "config": {"depth": 1, "batch": 2, "seq_len": 8, "steps": 3, "vocab": 64},
            "results": rows}


def test_the_probe_summary_takes_each_runs_own_ratio_and_keeps_refusals():
    def row(label, tps, speed, ran=True):
        return {"label": label, "ran": ran, "tokens_per_s": tps, "speedup": speed, "final_loss": 2.0,
                "reason": None if ran else "needs a GPU"}
    runs = [probe("cpu", [row("bf16", 100, 1.0), row("fp8", 150, 1.5), row("te-fp8", None, None, ran=False)]),
            probe("cpu", [row("bf16", 50, 1.0), row("fp8", 60, 1.2), row("te-fp8", None, None, ran=False)]),
            probe("cpu", [row("bf16", 80, 1.0), row("fp8", 100, 1.25), row("te-fp8", None, None, ran=False)])]
    s = probe_spread.summarise(runs)
    fp8 = next(e for e in s["entries"] if e["label"] == "fp8")
    assert fp8["speedup"] == {"median": 1.25, "min": 1.2, "max": 1.5, "n": 3}  # not 100 / 80 across runs
    assert fp8["tokens_per_s"]["median"] == 100 and fp8["ran"] == 3
    te = next(e for e in s["entries"] if e["label"] == "te-fp8")
    assert te["ran"] == 0 and te["reasons"] == ["needs a GPU"] and "speedup" not in te
    assert "| te-fp8 | 0 of 3 | needs a GPU" in probe_spread.to_markdown(s)
    with pytest.raises(ValueError, match="different devices"):
        probe_spread.summarise(runs + [probe("NVIDIA H200, sm_90", [])])
