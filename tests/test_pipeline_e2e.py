"""The real pipeline under real DVC, on a tiny configuration, in a copy of the project.

- `dvc repro` runs every stage and writes the final model directory, metrics and plots;
- a second `dvc repro` does nothing;
- changing an SFT parameter re-runs exactly sft, the SFT model's evaluation and export (after `params`,
  which resolves them): the base and midtrained models are not scored again;
- editing the selected profile's sft block does the same; editing a profile not in use re-runs nothing;
- sft runs as two data-parallel CPU ranks under fp8 with delayed scaling;
- pretrain killed with SIGKILL mid-run resumes from its checkpoint on the next `dvc repro` and ends
  exactly where an uninterrupted run ends, with the same loss plot (rows before the checkpoint kept);
- a last.pt full of garbage is moved aside with a message, and the stage resumes from prev.pt.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from project_files import committed_text, copy_project
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
TINY["rl"] = {"steps": 2, "prompts_per_step": 2, "samples": 2, "max_new_tokens": 8, "device_batch": 4, "eval_items": 4,
              "passk_items": 2}
for _stage in ("pretrain", "midtrain", "sft"):
    TINY[_stage] = {"steps": 3, "total_batch_tokens": 512, "device_batch": 8, "eval_every": 3,
                    "eval_tokens": 512, "checkpoint_every": 2, "log_every": 1}


def deep_update(d: dict, u: dict) -> dict:
    for k, v in u.items():
        d[k] = deep_update(d.get(k, {}), v) if isinstance(v, dict) else v
    return d


def make_project(tmp: Path, overrides: dict) -> Path:
    proj = tmp / "proj"
    copy_project(ROOT, proj, leave_out=("bench",))  # the project's files only: never a .venv or caches
    params = deep_update(yaml.safe_load(committed_text(ROOT, "params.yaml")), overrides)
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
    assert sorted(ran_stages(r.stdout)) == sorted(["params", "prepare", "tokenizer", "tokenize", "pretrain", "midtrain",
                                                   "sft", "rl", "evaluate@base", "evaluate@midtrain", "evaluate@sft",
                                                   "evaluate@rl", "export"])
    model = proj / paths.CHAT_MODEL
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation.json"):
        assert (model / name).is_file()
    card = (proj / paths.HF_EXPORT / "README.md").read_text()  # the export quotes the eval it came after
    assert "## Evaluation" in card and "| arithmetic |" in card
    def report(model: str, kind) -> dict:
        return json.loads((proj / kind(paths.eval_reports(model))).read_text())

    assert 0.0 <= report("sft", paths.metrics_file)["arithmetic"] <= 1.0
    # every benchmark, from the committed fixtures: by log-likelihood for the base models, by generation for
    # the chat model, each with its chance level and centred accuracy
    for model, tasks in [("base", ("arc_easy", "arc_challenge", "mmlu", "hellaswag", "lambada")),
                         ("sft", ("arc_easy", "arc_challenge", "mmlu", "hellaswag", "gsm8k"))]:
        details = report(model, paths.details_file)
        for task in tasks:
            assert 0.0 <= details["benchmarks"][task] <= 1.0 and task in details["chance"] and task in details["centered"]
    assert "core" in report("midtrain", paths.metrics_file) and "core" in report("sft", paths.metrics_file)
    assert "chatcore" in report("sft", paths.details_file)["centered"]
    assert "\tgsm8k\t" in (proj / paths.plot_file(paths.eval_reports("sft"))).read_text()
    shown = dvc(proj, "metrics", "show").stdout
    assert str(paths.metrics_file(paths.eval_reports("sft"))) in shown and "val_bpb_text" in shown

    assert ran_stages(dvc(proj, "repro").stdout) == []

    params = yaml.safe_load((proj / "params.yaml").read_text())
    params["sft"]["matrix_lr"] = 0.003
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert sorted(ran_stages(dvc(proj, "repro").stdout)) == ["evaluate@rl", "evaluate@sft", "export", "params", "rl", "sft"]

    # a profile: selecting one whose values equal the current ones re-runs nothing past `params`;
    # editing its sft block re-runs sft, its evaluation and export; editing a profile not in use re-runs nothing
    (proj / "profiles" / "mine.yaml").write_text(yaml.safe_dump({"sft": {"matrix_lr": 0.003}}))
    params["profile"] = "mine"
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert ran_stages(dvc(proj, "repro").stdout) == ["params"]
    (proj / "profiles" / "mine.yaml").write_text(yaml.safe_dump({"sft": {"matrix_lr": 0.004}}))
    assert sorted(ran_stages(dvc(proj, "repro").stdout)) == ["evaluate@rl", "evaluate@sft", "export", "params", "rl", "sft"]
    (proj / "profiles" / "h200.yaml").write_text((proj / "profiles" / "h200.yaml").read_text() + "\n# edited\n")
    assert ran_stages(dvc(proj, "repro").stdout) == ["params"]

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
    assert math.isfinite(sft_metrics["train_loss"])
    sft_details = json.loads((proj / paths.details_file("sft")).read_text())
    assert sft_details["backend_label"] == "fp8[delayed,history=16]"  # the options, one file from dvc metrics show


def kill_pretrain_when(proj: Path, appears: Path) -> None:
    """Runs `dvc repro pretrain` and kills it with SIGKILL as soon as `appears` exists."""
    p = subprocess.Popen(["dvc", "repro", "pretrain"], cwd=proj, env=env(), start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not appears.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert appears.exists(), f"{appears} did not appear"
    os.killpg(p.pid, signal.SIGKILL)  # dvc and the stage, as a crash or an OOM kill would
    p.wait()
    assert not (proj / paths.metrics_file("pretrain")).exists(), "the stage finished before the kill"


def test_kill9_during_pretrain_resumes(tmp_path):
    long = deep_update(json.loads(json.dumps(TINY)), {"pretrain": {"steps": 40, "checkpoint_every": 5}})
    ref = make_project(tmp_path / "ref", long)
    dvc(ref, "repro", "pretrain")
    want = json.loads((ref / paths.metrics_file("pretrain")).read_text())

    proj = make_project(tmp_path / "killed", long)
    dvc(proj, "repro", "tokenize")
    ckpt = proj / paths.checkpoint_dir("pretrain") / "last.pt"
    kill_pretrain_when(proj, ckpt.with_name("last.pt.sha256"))  # a checkpoint counts once its checksum is written

    r = dvc(proj, "repro", "pretrain")
    assert "resuming from checkpoint at step" in r.stderr
    got = json.loads((proj / paths.metrics_file("pretrain")).read_text())
    assert (proj / paths.details_file("pretrain")).read_text() == (ref / paths.details_file("pretrain")).read_text()
    assert got["train_loss"] == pytest.approx(want["train_loss"], abs=1e-3)
    assert got["val_bpb_text"] == pytest.approx(want["val_bpb_text"], abs=1e-3)
    assert not ckpt.exists(), "a finished stage keeps its checkpoint (a code change would resume from it)"
    for plot in (paths.plot_file("pretrain"), paths.val_file("pretrain")):
        assert (proj / plot).read_text() == (ref / plot).read_text(), f"the resumed {plot} differs from the unbroken run's"


def test_garbage_checkpoint_is_moved_aside_and_the_stage_finishes(tmp_path):
    """What a power cut can leave: last.pt full of garbage. The next `dvc repro` names it, moves it aside,
    resumes from the checkpoint before it (prev.pt) and finishes, without a traceback."""
    long = deep_update(json.loads(json.dumps(TINY)), {"pretrain": {"steps": 40, "checkpoint_every": 5}})
    proj = make_project(tmp_path, long)
    dvc(proj, "repro", "tokenizer")
    ckpt = paths.checkpoint_dir("pretrain") / "last.pt"
    kill_pretrain_when(proj, proj / ckpt.with_name("prev.pt"))  # the second checkpoint is being written
    (proj / ckpt).write_bytes(os.urandom(4096))

    r = dvc(proj, "repro", "pretrain")
    assert f"damaged checkpoint {ckpt} " in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert re.search(rf"moved aside to {re.escape(str(ckpt))}\.damaged-\S+; resuming from checkpoint at step \d+ "
                     rf"of {re.escape(str(ckpt.with_name('prev.pt')))}", r.stderr), r.stderr[-3000:]
    assert len(list((proj / ckpt.parent).glob("last.pt.damaged-*"))) == 1
    assert json.loads((proj / paths.details_file("pretrain")).read_text())["steps"] == 40


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_next_run_finishes(tmp_path):
    """pretrain under a file-size limit (RLIMIT_FSIZE, `ulimit -f`) below its checkpoint's size: the first
    checkpoint write fails, and the stage says so in one line naming the file and the free space (no
    traceback); the next run, without the limit, finishes."""
    import resource
    proj = make_project(tmp_path, TINY)
    dvc(proj, "repro", "tokenize")
    limit = 128 * 1024  # the tiny model's checkpoint (weights and Muon/AdamW state) is about 1 MB; no file before it passes 128 KiB

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = subprocess.run([sys.executable, "-m", "pipeline.pretrain"], cwd=proj, env=env(), capture_output=True,
                       text=True, timeout=300, preexec_fn=cap)
    ckpt = paths.checkpoint_dir("pretrain") / "last.pt"
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "RuntimeError" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"pretrain: cannot write {re.escape(str(ckpt))}: the file size limit of this process "
                        rf"\(`ulimit -f`\) reached; [\d.]+ \S+ free on the filesystem holding "
                        rf"{re.escape(str(ckpt.parent))}\. Free some space and run it again: .*", last), last
    assert not (proj / ckpt.with_name("last.pt.tmp")).exists()
    assert ran_stages(dvc(proj, "repro", "pretrain").stdout) == ["pretrain"]
    assert json.loads((proj / paths.details_file("pretrain")).read_text())["steps"] == TINY["pretrain"]["steps"]
