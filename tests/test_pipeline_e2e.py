"""The real pipeline under real DVC, on a tiny configuration, in a copy of the project.

- `dvc repro` runs every stage and writes the final model directory, metrics and plots;
- a second `dvc repro` does nothing;
- changing an SFT parameter re-runs exactly sft and evaluate;
- sft runs as two data-parallel CPU ranks under fp8 with delayed scaling;
- pretrain killed with SIGKILL mid-run resumes from its checkpoint on the next `dvc repro` and ends
  exactly where an uninterrupted run ends.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sparkchat import paths

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

TINY = {
    "model": {"depth": 2, "aspect_ratio": 32, "head_dim": 16, "kv_head_ratio": 2, "seq_len": 64},
    "data": {"synthetic_train": 600, "synthetic_eval": 8},
    "tokenizer": {"vocab_size": 320, "train_chars": 100_000},
    "runtime": {"threads": 1},
    "evaluate": {"max_items": 4, "max_new_tokens": 8},
}
for _stage in ("pretrain", "midtrain", "sft"):
    TINY[_stage] = {"steps": 3, "total_batch_tokens": 512, "device_batch": 8, "eval_every": 3,
                    "eval_tokens": 512, "checkpoint_every": 2, "log_every": 1}


def deep_update(d: dict, u: dict) -> dict:
    for k, v in u.items():
        d[k] = deep_update(d.get(k, {}), v) if isinstance(v, dict) else v
    return d


def make_project(tmp: Path, overrides: dict) -> Path:
    proj = tmp / "proj"
    shutil.copytree(ROOT, proj, ignore=shutil.ignore_patterns(".git", "artifacts", "__pycache__", "tmp", "*.egg-info",
                                                              "test-artifacts", ".gpu-stage", ".whl", "bench"))
    params = deep_update(yaml.safe_load((ROOT / "params.yaml").read_text()), overrides)
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["dvc", "config", "core.no_scm", "true"], cwd=proj, check=True, capture_output=True)
    subprocess.run(["dvc", "config", "core.analytics", "false"], cwd=proj, check=True, capture_output=True)
    return proj


def env() -> dict:
    e = dict(os.environ)
    e.pop("PYTHONPATH", None)  # the copy runs its own code, from its root
    e["DVC_NO_ANALYTICS"] = "1"
    e.pop("WORLD_SIZE", None)
    return e


def dvc(proj: Path, *args, timeout=600) -> subprocess.CompletedProcess:
    r = subprocess.run(["dvc", *args], cwd=proj, capture_output=True, text=True, env=env(), timeout=timeout)
    assert r.returncode == 0, f"dvc {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def ran_stages(out: str) -> list[str]:
    return [line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage '")]


def test_repro_noop_and_param_change(tmp_path):
    proj = make_project(tmp_path, TINY)
    r = dvc(proj, "repro")
    assert ran_stages(r.stdout) == ["prepare", "tokenizer", "tokenize", "pretrain", "midtrain", "sft", "evaluate"]
    model = proj / paths.CHAT_MODEL
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation.json"):
        assert (model / name).is_file()
    scores = json.loads((proj / paths.metrics_file("evaluate")).read_text())
    assert {"base", "midtrain", "sft", "chance"} <= set(scores)
    assert 0.0 <= scores["sft"]["arithmetic"] <= 1.0
    shown = dvc(proj, "metrics", "show").stdout
    assert str(paths.metrics_file("evaluate")) in shown and "val_bpb" in shown

    assert ran_stages(dvc(proj, "repro").stdout) == []

    params = yaml.safe_load((proj / "params.yaml").read_text())
    params["sft"]["matrix_lr"] = 0.003
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert ran_stages(dvc(proj, "repro").stdout) == ["sft", "evaluate"]

    # the data-parallel path: sft as two CPU ranks (torchrun, gloo) under fp8 with delayed scaling,
    # whose amax histories the backend reduces across ranks every step
    params["runtime"]["nproc"] = 2
    params["sft"]["backend"] = "fp8"
    params["precision"]["fp8"]["scaling"] = "delayed"
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "pipeline.sft"], cwd=proj, env=env(), capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "x 2 rank(s)" in out and "fp8[delayed,history=16]" in out and "sft: done" in out
    sft_metrics = json.loads((proj / paths.metrics_file("sft")).read_text())
    assert math.isfinite(sft_metrics["final_loss"])
    assert sft_metrics["backend_label"] == "fp8[delayed,history=16]"  # the options, for dvc metrics show


def test_kill9_during_pretrain_resumes(tmp_path):
    long = deep_update(json.loads(json.dumps(TINY)), {"pretrain": {"steps": 40, "checkpoint_every": 5}})
    ref = make_project(tmp_path / "ref", long)
    dvc(ref, "repro", "pretrain")
    want = json.loads((ref / paths.metrics_file("pretrain")).read_text())

    proj = make_project(tmp_path / "killed", long)
    dvc(proj, "repro", "tokenize")
    ckpt = proj / paths.checkpoint_dir("pretrain") / "last.pt"
    p = subprocess.Popen(["dvc", "repro", "pretrain"], cwd=proj, env=env(), start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not ckpt.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert ckpt.exists(), "no checkpoint appeared"
    os.killpg(p.pid, signal.SIGKILL)  # dvc and the stage, as a crash or an OOM kill would
    p.wait()
    assert not (proj / paths.metrics_file("pretrain")).exists(), "the stage finished before the kill"

    r = dvc(proj, "repro", "pretrain")
    assert "resuming from checkpoint at step" in r.stderr
    got = json.loads((proj / paths.metrics_file("pretrain")).read_text())
    assert got["steps"] == want["steps"]
    assert got["final_loss"] == pytest.approx(want["final_loss"], abs=1e-3)
    assert got["val_bpb"] == pytest.approx(want["val_bpb"], abs=1e-3)
    assert not ckpt.exists(), "a finished stage keeps its checkpoint (a code change would resume from it)"
