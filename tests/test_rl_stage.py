"""The rl stage under real DVC, on a tiny configuration, in a copy of the project (slow: the pipeline up to
SFT runs first).

- rl killed with SIGKILL mid-run resumes from its checkpoint on the next `dvc repro` and ends on the same
  model bytes, reward plot, held-out plot and metrics as an uninterrupted run;
- a changed rl param re-runs exactly rl and the stages after it;
- rl runs as two CPU ranks (torchrun, gloo) under DDP and under FSDP, the prompts split between them;
- rl.enabled false: the chat model is SFT's, byte for byte.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sparkchat import paths
from test_pipeline_e2e import TINY, deep_update, dvc, env, make_project, ran_stages

pytestmark = pytest.mark.slow

RL_TINY = deep_update(json.loads(json.dumps(TINY)), {"rl": {
    "tasks": ["letter_count", "largest"], "steps": 24, "prompts_per_step": 4, "samples": 2, "max_new_tokens": 8, "device_batch": 4, "eval_items": 4,
    "passk_items": 2, "checkpoint_every": 3}})


def model_hash(proj: Path) -> str:
    return hashlib.sha256((proj / paths.CHAT_MODEL / "model.safetensors").read_bytes()).hexdigest()


def reports(proj: Path) -> dict:
    files = (paths.metrics_file("rl"), paths.details_file("rl"), paths.plot_file("rl"), paths.RL_HELDOUT)
    return {str(f): (proj / f).read_text() for f in files}


def set_params(proj: Path, **sections) -> None:
    params = yaml.safe_load((proj / "params.yaml").read_text())
    (proj / "params.yaml").write_text(yaml.safe_dump(deep_update(params, sections), sort_keys=False))


def run_rl(proj: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "pipeline.rl"], cwd=proj, env=env(), capture_output=True, text=True,
                       timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    return out


def test_rl_resumes_after_kill9_and_reruns_alone(tmp_path):
    proj = make_project(tmp_path, RL_TINY)
    r = dvc(proj, "repro", "rl")
    assert ran_stages(r.stdout)[-1] == "rl"
    want_model, want_reports = model_hash(proj), reports(proj)
    assert model_hash(proj) != hashlib.sha256((proj / paths.MODEL_DIRS["sft"] / "model.safetensors")
                                              .read_bytes()).hexdigest()
    assert not (proj / paths.checkpoint_dir("rl") / "last.pt").exists()

    # the same run again, killed with SIGKILL once a checkpoint is complete; the next repro resumes from it
    ckpt = proj / paths.checkpoint_dir("rl") / "last.pt"
    (proj / paths.metrics_file("rl")).unlink()
    p = subprocess.Popen(["dvc", "repro", "--force", "--single-item", "rl"], cwd=proj, env=env(),
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sidecar = ckpt.with_name("last.pt.sha256")
    deadline = time.time() + 300
    while not sidecar.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.02)
    assert sidecar.exists(), "no checkpoint appeared"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not (proj / paths.metrics_file("rl")).exists(), "the stage finished before the kill"
    r = dvc(proj, "repro", "rl")
    assert "resuming from checkpoint at step" in r.stderr
    assert model_hash(proj) == want_model, "the resumed model's bytes differ from the unbroken run's"
    assert reports(proj) == want_reports

    # a changed rl param re-runs rl and what follows it, nothing before
    dvc(proj, "repro")  # evaluate and export, which `dvc repro rl` left out
    set_params(proj, rl={"seed": 8})
    assert sorted(ran_stages(dvc(proj, "repro").stdout)) == ["evaluate@rl", "export", "params", "rl"]

    # two CPU ranks (torchrun, gloo), the prompts split between them: DDP, then FSDP
    for parallel in ("ddp", "fsdp"):
        set_params(proj, runtime={"nproc": 2, "parallel": parallel}, rl={"steps": 2})
        out = run_rl(proj)
        assert f"{'FSDP' if parallel == 'fsdp' else 'DDP'} x 2 rank(s)" in out and "rl: done" in out, out[-2000:]
        details = json.loads((proj / paths.details_file("rl")).read_text())
        assert details["rollouts"] == 2 * 4 * 2 and set(details["after"]) == {"letter_count", "largest"}

    # off: the chat model is SFT's, unchanged
    set_params(proj, runtime={"nproc": 1, "parallel": "ddp"}, rl={"enabled": False})
    run_rl(proj)
    assert model_hash(proj) == hashlib.sha256((proj / paths.MODEL_DIRS["sft"] / "model.safetensors")
                                              .read_bytes()).hexdigest()
    assert json.loads((proj / paths.details_file("rl")).read_text()) == {"enabled": False}
