"""Training checkpoints: model, optimizer, data position, RNG, written atomically, resumed safely.

A checkpoint carries a fingerprint of everything the run depends on (the stage's params, the model
shape, the input files' hashes). A stage only resumes a checkpoint whose fingerprint matches, so a
changed parameter starts fresh instead of continuing a different run.

A stage's checkpoint directory holds

    last.pt, last.pt.sha256   the newest checkpoint and its size and sha256 (JSON)
    prev.pt, prev.pt.sha256   the one before it, kept so a damaged newest one falls back to it

A checkpoint file is fsynced before its rename, and its checksum is written after it: a checkpoint
counts only once its checksum file matches it. On load, a checkpoint that is truncated, empty,
overwritten or without its checksum (what a power cut or a full disk can leave) is moved aside to
`<name>.damaged-<time>` with a message naming it, and the stage resumes from prev.pt or from step 0.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch

from model.model_dir import (check_file, file_record, fsync_dir, portable_state_dict, sha256_file, temp_name,
                             write_atomic)

PREV = "prev.pt"


def file_hash(path: Path) -> str:
    """One hash of a file, or of every file under a folder (names included)."""
    h = hashlib.sha256()
    paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in paths:
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def fingerprint(config: dict, inputs: list[Path]) -> str:
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for p in inputs:
        h.update(file_hash(p).encode())
    return h.hexdigest()[:16]


def rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _recorded(path: Path) -> dict | None:
    """The size and sha256 written beside `path`, or None when that file is missing or unreadable."""
    try:
        r = json.loads(_sidecar(path).read_text())
        return {"size": int(r["size"]), "sha256": str(r["sha256"])}
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _write_record(path: Path, record: dict) -> None:
    write_atomic(_sidecar(path), lambda p: p.write_text(json.dumps(record) + "\n"))


def save_checkpoint(path: Path, model, optimizer, step: int, data_state: dict, fp: str, extra: dict) -> None:
    """Writes the checkpoint to `path` (last.pt); the one it replaces becomes prev.pt. Every moment of the
    sequence leaves one checkpoint that passes its check, so a crash anywhere loses at most this one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prev = path.with_name(PREV)
    record = _recorded(path)
    if path.exists() and record is not None:
        _write_record(prev, record)  # prev.pt fails its check until the rename; last.pt still passes
        os.replace(path, prev)  # now prev.pt passes and last.pt is absent
        fsync_dir(path.parent)
    state = {"model": portable_state_dict(model), "optimizer": optimizer.state_dict(), "step": step,
             "data": data_state, "rng": rng_state(), "fingerprint": fp, "extra": extra}
    write_atomic(path, lambda p: torch.save(state, p))
    _write_record(path, file_record(path))  # last: the commit point


def _move_aside(path: Path) -> Path:
    """Renames a damaged checkpoint (and its checksum file) out of the way, kept for inspection."""
    suffix = f".damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    dest = path.with_name(path.name + suffix)
    for src, dst in ((path, dest), (_sidecar(path), _sidecar(path).with_name(_sidecar(path).name + suffix))):
        with contextlib.suppress(FileNotFoundError):  # under torchrun another rank may have moved it first
            os.replace(src, dst)
    return dest


def _damage(path: Path) -> str | None:
    record = _recorded(path)
    if record is None:
        return (f"has no readable checksum file {_sidecar(path).name} (its save was cut short, or an older "
                f"sparkchat wrote it)")
    return check_file(path, record)


def load_checkpoint(path: Path, fp: str) -> tuple[dict | None, str]:
    """Returns (checkpoint, message): the newest intact checkpoint of this configuration, trying `path`
    (last.pt) and then prev.pt; None when neither holds one. Damaged ones are moved aside, never raised."""
    notes = []
    for candidate in (path, path.with_name(PREV)):
        if not candidate.exists():
            continue
        problem = _damage(candidate)
        if problem is None:
            try:
                ckpt = torch.load(candidate, map_location="cpu", weights_only=False)
            except Exception as e:  # intact bytes this code cannot read: as unusable as damaged ones
                problem = f"cannot be read ({type(e).__name__}: {e})"
        if problem:
            notes.append(f"damaged checkpoint {candidate} {problem}; moved aside to {_move_aside(candidate)}")
            continue
        if ckpt.get("fingerprint") != fp:
            notes.append(f"checkpoint {candidate} is from a different configuration or inputs")
            continue
        which = "" if candidate == path else f" of {candidate}"
        return ckpt, "; ".join(notes + [f"resuming from checkpoint at step {ckpt['step']}{which}"])
    return None, "; ".join(notes) + "; starting from step 0" if notes else "no checkpoint: starting from step 0"


def remove_checkpoints(path: Path) -> None:
    """Once the stage's model is saved: last.pt, prev.pt and their checksums go, with what a save cut short
    left behind (damaged ones moved aside stay, for inspection)."""
    for p in (path, path.with_name(PREV)):
        for f in (p, _sidecar(p)):
            f.unlink(missing_ok=True)
            temp_name(f).unlink(missing_ok=True)
