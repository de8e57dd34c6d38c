"""Checkpoints and model directories that fail safe (what a power cut, a full disk or a bad sector leaves).

- a checkpoint that is truncated, empty, garbage, has 4 KiB overwritten or lost its checksum file is
  moved aside with a message naming it, and loading falls back to the previous checkpoint or to step 0;
- a save cut short at any point leaves a checkpoint that loads; a good one resumes as before;
- a model directory with a truncated or overwritten file, or a missing one, raises an error naming the
  file, and `python -m serve` on it exits non-zero with that message before the server starts;
- a model directory without checksums.json is refused (the server too) unless the user trusts it
  (TRUST_ENV=1), then it loads with a warning.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.gpt import GPT, GPTConfig
from model.model_dir import CHECKSUMS, TRUST_ENV, ModelDirError, NoRoomError, load_model_dir, save_model_dir
from pipeline.checkpoint import load_checkpoint, remove_checkpoints, save_checkpoint

ROOT = Path(__file__).resolve().parent.parent
FP = "fingerprint-of-this-run"


def tiny_model() -> GPT:
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, seq_len=16))
    model.init_weights(seed=0)
    return model


def save_at(path: Path, model: GPT, optimizer, step: int) -> None:
    """A checkpoint whose weights say which step wrote it (wte[0, 0] == step)."""
    with torch.no_grad():
        model.wte.weight[0, 0] = step
    save_checkpoint(path, model, optimizer, step, {"pos": step}, FP, {"val_bpb": step / 10})


# ways a file gets damaged; each leaves it in place, so only the checksum can tell
def truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def empty(f: Path) -> None:
    f.write_bytes(b"")


def garbage(f: Path) -> None:
    f.write_bytes(os.urandom(1000))


def overwrite_4k(f: Path) -> None:
    with open(f, "r+b") as h:  # same size, same header: only the sha256 differs
        h.seek(f.stat().st_size // 2)
        h.write(os.urandom(4096))


def drop_checksum(f: Path) -> None:
    f.with_name(f.name + ".sha256").unlink()


DAMAGE = [truncate, empty, garbage, overwrite_4k, drop_checksum]


@pytest.fixture
def run(tmp_path):
    model = tiny_model()
    return tmp_path / "ckpt" / "last.pt", model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_good_checkpoint_resumes_unchanged(run):
    path, model, opt = run
    save_at(path, model, opt, 2)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt, msg = load_checkpoint(path, FP)
    assert msg == "resuming from checkpoint at step 2"
    assert ckpt["step"] == 2 and ckpt["data"] == {"pos": 2} and ckpt["fingerprint"] == FP
    for k, v in want.items():
        torch.testing.assert_close(ckpt["model"][k], v, rtol=0, atol=0)
    fresh = torch.optim.AdamW(tiny_model().parameters(), lr=1e-3)
    fresh.load_state_dict(ckpt["optimizer"])
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pt", "last.pt.sha256"]


def test_saves_keep_the_previous_checkpoint(run):
    path, model, opt = run
    for step in (2, 4, 6):
        save_at(path, model, opt, step)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pt", "last.pt.sha256", "prev.pt",
                                                             "prev.pt.sha256"]
    assert torch.load(path.with_name("prev.pt"), weights_only=False)["step"] == 4
    assert load_checkpoint(path, FP)[0]["step"] == 6
    ckpt, msg = load_checkpoint(path, "another-configuration")
    assert ckpt is None and "different configuration" in msg and msg.endswith("starting from step 0")


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_damaged_last_falls_back_to_prev(run, damage):
    path, model, opt = run
    save_at(path, model, opt, 4)
    save_at(path, model, opt, 6)
    damage(path)
    ckpt, msg = load_checkpoint(path, FP)
    assert ckpt is not None and ckpt["step"] == 4 and ckpt["model"]["wte.weight"][0, 0] == 4
    (moved,) = path.parent.glob("last.pt.damaged-*")  # kept for inspection, with its checksum file
    assert not path.exists() and (damage is drop_checksum or moved.with_name(
        moved.name.replace("last.pt", "last.pt.sha256")).exists())
    assert msg.startswith(f"damaged checkpoint {path} ") and f"moved aside to {moved}" in msg, msg
    assert msg.endswith(f"resuming from checkpoint at step 4 of {path.with_name('prev.pt')}"), msg
    # the next save starts a new last.pt beside the good prev.pt, and it loads
    save_at(path, model, opt, 8)
    assert load_checkpoint(path, FP)[1] == "resuming from checkpoint at step 8"


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_damaged_only_checkpoint_starts_from_scratch(run, damage):
    path, model, opt = run
    save_at(path, model, opt, 2)
    damage(path)
    ckpt, msg = load_checkpoint(path, FP)
    assert ckpt is None
    assert msg.startswith(f"damaged checkpoint {path} ") and msg.endswith("; starting from step 0"), msg
    (moved,) = path.parent.glob("last.pt.damaged-*")
    assert f"moved aside to {moved}" in msg and not path.exists()
    assert load_checkpoint(path, FP) == (None, "no checkpoint: starting from step 0")


def test_both_damaged_start_from_scratch(run):
    path, model, opt = run
    save_at(path, model, opt, 2)
    save_at(path, model, opt, 4)
    overwrite_4k(path)
    truncate(path.with_name("prev.pt"))
    ckpt, msg = load_checkpoint(path, FP)
    assert ckpt is None and msg.count("damaged checkpoint") == 2 and msg.endswith("; starting from step 0")
    assert str(path) in msg and str(path.with_name("prev.pt")) in msg


def test_a_finished_stage_removes_its_checkpoints_but_not_damaged_ones(run):
    path, model, opt = run
    for step in (2, 4, 6):
        save_at(path, model, opt, step)
    overwrite_4k(path)
    load_checkpoint(path, FP)  # moves last.pt aside
    save_at(path, model, opt, 8)
    path.with_name("last.pt.tmp").write_bytes(b"left by a save cut short")
    remove_checkpoints(path)
    left = sorted(p.name for p in path.parent.iterdir())
    assert len(left) == 2 and all(".damaged-" in name for name in left), left


def test_damaged_checkpoints_moved_aside_are_bounded(run, monkeypatch):
    """Four incidents, each moving a damaged last.pt aside (and an old damaged sharded folder already
    there): only the KEEP_DAMAGED newest stay, each with its checksum file; the message names the deleted."""
    import types
    from pipeline import checkpoint
    path, model, opt = run
    clock = iter(f"20260101-00000{i}" for i in range(1, 10))
    monkeypatch.setattr(checkpoint, "time", types.SimpleNamespace(strftime=lambda fmt: next(clock)))
    old_dcp = path.with_name("last.dcp.damaged-20250101-000000")
    old_dcp.mkdir(parents=True)
    (old_dcp / "__0_0.distcp").write_bytes(b"shard")
    path.with_name("last.dcp.sha256.damaged-20250101-000000").write_text("{}")
    messages = []
    for step in (2, 4, 6, 8):
        save_at(path, model, opt, step)
        overwrite_4k(path)
        messages.append(load_checkpoint(path, FP)[1])
    left = sorted(p.name for p in path.parent.iterdir() if ".damaged-" in p.name)
    assert checkpoint.KEEP_DAMAGED == 2 and left == [
        "last.pt.damaged-20260101-000003", "last.pt.damaged-20260101-000004",
        "last.pt.sha256.damaged-20260101-000003", "last.pt.sha256.damaged-20260101-000004"], left
    assert "deleted" not in messages[0]
    assert "older damaged checkpoints deleted, the newest 2 kept: last.dcp.damaged-20250101-000000" in messages[1]
    assert messages[3].endswith("kept: last.pt.damaged-20260101-000002); starting from step 0"), messages[3]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux), whose every write is ENOSPC")
def test_a_full_disk_is_one_error_naming_the_file_and_the_free_space(run):
    """The kernel's own ENOSPC: the temporary file the save writes first is made a link to /dev/full.
    One NoRoomError naming last.pt and the free space (no torch RuntimeErrors), no partial file left,
    and the checkpoint before it still loads."""
    path, model, opt = run
    save_at(path, model, opt, 2)
    tmp = path.with_name("last.pt.tmp")
    tmp.symlink_to("/dev/full")
    with pytest.raises(NoRoomError) as e:
        save_at(path, model, opt, 4)
    assert re.fullmatch(rf"cannot write {re.escape(str(path))}: no space left on the device; [\d.]+ \S+ free on "
                        rf"the filesystem holding {re.escape(str(path.parent))}", str(e.value)), str(e.value)
    assert e.value.__suppress_context__, "torch's errors would print as a second traceback"
    assert not tmp.exists() and not tmp.is_symlink()
    ckpt, msg = load_checkpoint(path, FP)
    assert ckpt["step"] == 2 and "of " + str(path.with_name("prev.pt")) in msg


class Crash(Exception):
    pass


@pytest.mark.parametrize("at", range(5))
def test_a_save_cut_short_anywhere_leaves_a_checkpoint_that_loads(run, monkeypatch, at):
    """A save renames four times (prev's checksum, last -> prev, the new last.pt, its checksum); a
    crash before any of them leaves the old step or the new one loadable, never nothing."""
    path, model, opt = run
    save_at(path, model, opt, 2)
    save_at(path, model, opt, 4)
    replace, calls = os.replace, []

    def crashing_replace(src, dst):
        calls.append(dst)
        if len(calls) == at + 1:
            raise Crash(f"power cut before renaming to {dst}")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", crashing_replace)
    crashed = False
    try:
        save_at(path, model, opt, 6)
    except Crash:
        crashed = True
    monkeypatch.undo()
    assert crashed == (at < 4) and len(calls) == min(at + 1, 4)
    ckpt, msg = load_checkpoint(path, FP)
    assert ckpt is not None and ckpt["step"] == (6 if at == 4 else 4), msg
    assert ckpt["model"]["wte.weight"][0, 0] == ckpt["step"]


# ---- model directories ----

@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory, serve_tokenizer):
    tok = serve_tokenizer
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_embd=64, n_head=2, n_kv_head=1, seq_len=32))
    model.init_weights(seed=0)
    path = tmp_path_factory.mktemp("model")
    save_model_dir(path, model, tok, extra={"stage": "test"})
    return path


@pytest.fixture
def model_dir(saved_dir, tmp_path):
    return Path(shutil.copytree(saved_dir, tmp_path / "model"))


def test_model_dir_round_trip_with_checksums(model_dir, saved_dir):
    sums = json.loads((model_dir / CHECKSUMS).read_text())
    assert set(sums) == {"config.json", "model.safetensors", "tokenizer.json", "generation.json", "meta.json"}
    assert not list(model_dir.glob("*.tmp"))
    model, tok, gen = load_model_dir(model_dir)
    assert model.config.vocab_size == tok.vocab_size and gen["max_tokens"] > 0


def corrupt_config(f: Path) -> None:
    f.write_text(f.read_text().replace("{", "[", 1))


MODEL_DAMAGE = [("model.safetensors", truncate), ("model.safetensors", overwrite_4k),
                ("config.json", corrupt_config), ("tokenizer.json", Path.unlink)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name,damage", MODEL_DAMAGE, ids=lambda x: getattr(x, "__name__", x))
def test_damaged_model_dir_names_the_file(model_dir, name, damage):
    damage(model_dir / name)
    with pytest.raises(ModelDirError, match=name.replace(".", r"\.")) as e:
        load_model_dir(model_dir)
    assert str(model_dir) in str(e.value)

    # the server stops before it opens a port, saying which file is damaged
    r = subprocess.run([sys.executable, "-m", "serve", "--model", str(model_dir), "--port", str(free_port())],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert f"sparkchat serve: model directory {model_dir} is damaged: {name}" in r.stderr, out
    assert "Traceback" not in out and "Uvicorn running" not in out and "Started server process" not in out


def test_a_model_dir_is_hashed_once_per_process_until_a_file_changes(model_dir, monkeypatch):
    """`sparkchat serve` verifies before its port opens and loads after: the weights are hashed once. A file
    written since (same size, other bytes) is hashed again, and named."""
    import model.model_dir as md
    hashed = []
    check = md.check_file
    monkeypatch.setattr(md, "check_file", lambda p, r: hashed.append(p.name) or check(p, r))
    md.verify_model_dir(model_dir)
    load_model_dir(model_dir)
    assert sorted(hashed) == sorted(json.loads((model_dir / CHECKSUMS).read_text()))  # each file once
    hashed.clear()
    overwrite_4k(model_dir / "model.safetensors")
    with pytest.raises(ModelDirError, match=r"model\.safetensors"):
        load_model_dir(model_dir)
    assert hashed == ["model.safetensors"]


def test_model_dir_without_checksums_is_refused_unless_trusted(model_dir, monkeypatch, caplog):
    """The issue's case: checksums.json deleted and 4 KiB of the weights overwritten. Refused, the error
    naming the missing file and the variable that trusts it; trusted, it loads with a warning."""
    (model_dir / CHECKSUMS).unlink()
    overwrite_4k(model_dir / "model.safetensors")
    monkeypatch.delenv(TRUST_ENV, raising=False)
    with pytest.raises(ModelDirError, match=f"{model_dir} has no {CHECKSUMS}.*set {TRUST_ENV}=1"):
        load_model_dir(model_dir)
    monkeypatch.setenv(TRUST_ENV, "0")  # only 1 trusts
    with pytest.raises(ModelDirError, match=TRUST_ENV):
        load_model_dir(model_dir)
    monkeypatch.setenv(TRUST_ENV, "1")
    with caplog.at_level("WARNING", logger="model.model_dir"):
        load_model_dir(model_dir)
    assert f"{model_dir} has no {CHECKSUMS} (trusted by {TRUST_ENV}=1)" in caplog.text
    # trusted, but a file that does not parse is still named
    corrupt_config(model_dir / "config.json")
    with pytest.raises(ModelDirError, match=r"config\.json cannot be loaded"):
        load_model_dir(model_dir)


def test_serve_refuses_a_model_dir_without_checksums_before_its_port_opens(model_dir):
    (model_dir / CHECKSUMS).unlink()
    env = {k: v for k, v in os.environ.items() if k != TRUST_ENV}
    r = subprocess.run([sys.executable, "-m", "serve", "--model", str(model_dir), "--port", str(free_port())],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert f"model directory {model_dir} has no {CHECKSUMS}" in r.stderr and f"{TRUST_ENV}=1" in r.stderr, out
    assert "Traceback" not in out and "Uvicorn running" not in out


def test_damaged_checksums_file_is_named(model_dir):
    (model_dir / CHECKSUMS).write_text("{not json")
    with pytest.raises(ModelDirError, match=f"{CHECKSUMS} cannot be read"):
        load_model_dir(model_dir)
