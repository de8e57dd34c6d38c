"""bench/vs_nanochat.py: the head-to-head against nanochat's base_train. The figures' arithmetic and the
raw JSON's check here; a real run of both loops on the CPU at a tiny depth where nanochat's files were
exported (bench/peers/nanochat/, git-ignored), skipped cleanly elsewhere."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import vs_nanochat as vs

ROOT = Path(__file__).resolve().parent.parent


def _run(dt, evals, loss=None):
    return vs.summarise_run(dict(dt=dt, loss=loss or [0.0] * len(dt), evals=evals), tokens_per_step=1000)


def test_tokens_per_s_and_bpb_at_equal_time():
    # 10 steps: the first slow (compile), then 0.1 s; evaluations after 5 and 10 steps
    fast = _run([5.0] + [0.1] * 9, [[5, 1.5], [10, 1.2]])
    assert fast["tokens_per_s"] == pytest.approx(10_000) and fast["tokens_per_s_trained"] == pytest.approx(10_000)
    assert fast["train_s"] == pytest.approx(5.9) and fast["evals"][0]["train_s"] == pytest.approx(5.4)
    slow = _run([5.0] + [0.2] * 9, [[0, 2.0], [5, 1.4], [10, 1.1]])
    assert vs.bpb_at(slow, 5.0) is None  # the step-0 evaluation is before training: not a mark's value
    assert vs.bpb_at(slow, 5.8) == 1.4 and vs.bpb_at(fast, 5.9) == 1.2
    rounds = [{"sparkchat-bf16": fast, "nanochat-bf16": slow, "sparkchat-fp8": fast, "nanochat-fp8": slow}] * 3
    out = vs.compare(rounds, depth=20)
    assert out["over_nanochat_tokens_per_s"]["bf16"]["median"] == pytest.approx(2.0)
    assert out["fp8_over_bf16_whole_step_d20"]["median"] == pytest.approx(1.0)
    assert out["fp8_loss_gap_pct"]["median"] == pytest.approx(0.0)
    # marks at fractions of the shortest run (fast: 5.9 s); at all of it fast has its final bpb, slow its 5-step one
    at_end = out["val_bpb_at_equal_time"]["4/4"]
    assert at_end["sparkchat-bf16"]["median"] == 1.2 and at_end["nanochat-bf16"]["median"] == 1.4


def test_nanochat_lines_are_read():
    """The lines the pinned base_train prints (its format, scripts/base_train.py at NANOCHAT_COMMIT)."""
    lines = ["Step 00000 | Validation bpb: 3.210000",
             "step 00000/00002 (0.00%) | loss: 10.397000 | lrm: 0.03 | dt: 45123.40ms | tok/sec: 11,620 | bf16_mfu: 0.50 "
             "| epoch: 0 pq: 0 rg: 0 | total time: 0.00m",
             "step 00001/00002 (50.00%) | loss: 10.100000 | lrm: 0.05 | dt: 312.50ms | tok/sec: 1,677,721 | bf16_mfu: 50.1 "
             "| epoch: 0 pq: 0 rg: 0 | total time: 0.00m",
             "Step 00002 | Validation bpb: 2.900000", "Peak memory usage: 1.00MiB"]
    rec = vs.parse_nanochat(lines)
    assert rec["dt"] == [pytest.approx(45.1234), pytest.approx(0.3125)] and rec["loss"] == [10.397, 10.1]
    assert rec["evals"] == [[0, 3.21], [2, 2.9]]


def test_check_reads_every_required_key(tmp_path, capsys):
    """`check` is bench/check_keys.py over the runs' files together, per-precision mappings counting as figures."""
    spread = {"median": 1.1, "min": 1.0, "max": 1.2, "n": 3}
    d12 = {"commit": "abc1234", "date": "2026-12-07T21:00:00+00:00", "steps": 1000,
           "over_nanochat_tokens_per_s": {"bf16": spread, "fp8": spread}, "fp8_loss_gap_pct": spread}
    (tmp_path / "d12.json").write_text(json.dumps(d12))

    def check(*names):
        with pytest.raises(SystemExit) as e:
            vs.main(["check"] + [str(tmp_path / n) for n in names])
        return e.value.code, capsys.readouterr().err

    code, err = check("d12.json")
    assert code == 1 and err == f"{tmp_path / 'd12.json'}: fp8_over_bf16_whole_step_d20: missing\n"
    d20 = dict(d12, fp8_over_bf16_whole_step_d20=spread)
    (tmp_path / "d20.json").write_text(json.dumps(d20))
    assert check("d12.json", "d20.json") == (0, "")
    bad = dict(d20, fp8_loss_gap_pct="small", commit="")
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    code, err = check("d12.json", "bad.json")  # every file's value must pass, not one of them
    assert code == 1 and "fp8_loss_gap_pct: not a number" in err and "commit: not a non-empty string ('')" in err


@pytest.mark.slow
@pytest.mark.skipif(not (vs.PEER_DIR / "COMMIT").is_file(),
                    reason="nanochat's files are not exported here (python -m bench.vs_nanochat export --from <git dir>)")
def test_both_loops_train_on_the_cpu(tmp_path):
    """The whole harness at a tiny depth on the CPU: both loops train on the same tokens and are evaluated on
    the same held-out bytes; the raw JSON carries the figures and passes the check's keys it can have."""
    out = tmp_path / "vs.json"
    cmd = [sys.executable, "-m", "bench.vs_nanochat", "run", "--depth", "2", "--head-dim", "64", "--seq-len", "64",
           "--vocab", "512", "--batch", "4", "--total-batch", "256", "--steps", "6", "--eval-every", "3", "--eval-tokens",
           "512", "--device", "cpu", "--text", "shakespeare", "--runs", "1", "--precisions", "bf16",
           "--work", str(tmp_path / "work"), "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True)
    res = json.loads(out.read_text())
    run = res["rounds"][0]
    assert set(run) == {"sparkchat-bf16", "nanochat-bf16"}
    for name, r in run.items():
        assert len(r["step_ms"]) == 6 and r["tokens_per_s"] > 0, name
        assert [e["step"] for e in r["evals"] if e["step"]] == [3, 6], name
        assert 0 < r["final_bpb"] < 20, name
    assert res["over_nanochat_tokens_per_s"]["bf16"]["n"] == 1 and res["steps"] == 6
    assert res["nanochat"]["commit"] == vs.NANOCHAT_COMMIT and res["commit"] and res["date"]
