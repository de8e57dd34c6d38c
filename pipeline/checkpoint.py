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
The folder keeps the newest KEEP_DAMAGED (2) of those, deleting older ones, so they cannot pile up.

Under FSDP (`runtime.parallel: fsdp`) no rank holds the whole model, so a checkpoint is a folder
written by every rank through `torch.distributed.checkpoint` (DCP): `last.dcp/` and `prev.dcp/`, each
holding every rank's shard files, DCP's `.metadata` and `train_state.pt` (step, data position, RNG,
fingerprint, plot rows), with `last.dcp.sha256` beside it (size and sha256 of every file in it). It is
written as `last.dcp.tmp/`, checked, renamed, and its checksum file written last, the same commit
sequence as a file's; the ranks share the hashing. DCP stores each tensor with its global shape, so a
checkpoint written by 4 ranks loads on 2 or on 1 (resharding as it reads). Every rank must see the
same folder: on several machines, a filesystem they all mount.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path

import torch

from model.model_dir import (check_file, file_record, fsync_dir, portable_state_dict, sha256_file, temp_name,
                             write_atomic)
from model.parallel import all_gather, barrier, broadcast

PREV = "prev.pt"
LAST_DIR, PREV_DIR = "last.dcp", "prev.dcp"  # sharded (FSDP) checkpoints: folders
TRAIN_STATE = "train_state.pt"  # in a sharded checkpoint: everything but the model and optimizer


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


def _torch_save(obj, path: Path) -> None:
    # through a Python file, so a failed write raises OSError with its errno (write_atomic names a full
    # disk from it); given a path, torch's own writer raises RuntimeErrors that name neither
    with open(path, "wb") as f:
        torch.save(obj, f)


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
    write_atomic(path, lambda p: _torch_save(state, p))
    _write_record(path, file_record(path))  # last: the commit point


# Damaged checkpoints moved aside that a stage's folder keeps, newest first. One load moves aside at most
# two (last and prev, when both are hit), so the latest incident is always kept whole for inspection, and
# the kept copies never take more room than the two live checkpoints do; older ones are deleted, named.
KEEP_DAMAGED = 2
DAMAGED = ".damaged-"


def _prune_damaged(folder: Path) -> list[str]:
    """Deletes all but the KEEP_DAMAGED newest damaged checkpoints in `folder` (each with its checksum
    file); returns the names deleted. The time in the name orders them (sortable, to the second)."""
    moved = [p for p in folder.glob(f"*{DAMAGED}*") if ".sha256" + DAMAGED not in p.name]
    moved.sort(key=lambda p: (p.name.rpartition(DAMAGED)[2], p.name), reverse=True)
    for p in moved[KEEP_DAMAGED:]:
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        base, _, when = p.name.rpartition(DAMAGED)
        (folder / f"{base}.sha256{DAMAGED}{when}").unlink(missing_ok=True)
    return [p.name for p in moved[KEEP_DAMAGED:]]


def _move_aside(path: Path) -> str:
    """Renames a damaged checkpoint (and its checksum file) out of the way, kept for inspection, and
    prunes the older ones; returns what it did, in words, for the log."""
    suffix = f"{DAMAGED}{time.strftime('%Y%m%d-%H%M%S')}"
    dest = path.with_name(path.name + suffix)
    for src, dst in ((path, dest), (_sidecar(path), _sidecar(path).with_name(_sidecar(path).name + suffix))):
        with contextlib.suppress(FileNotFoundError):  # under torchrun another rank may have moved it first
            os.replace(src, dst)
    removed = _prune_damaged(path.parent)
    return f"moved aside to {dest}" + (f" (older damaged checkpoints deleted, the newest {KEEP_DAMAGED} kept: "
                                       f"{', '.join(removed)})" if removed else "")


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
            notes.append(f"damaged checkpoint {candidate} {problem}; {_move_aside(candidate)}")
            continue
        if ckpt.get("fingerprint") != fp:
            notes.append(f"checkpoint {candidate} is from a different configuration or inputs")
            continue
        which = "" if candidate == path else f" of {candidate}"
        return ckpt, "; ".join(notes + [f"resuming from checkpoint at step {ckpt['step']}{which}"])
    return None, "; ".join(notes) + "; starting from step 0" if notes else "no checkpoint: starting from step 0"


def remove_checkpoints(path: Path) -> None:
    """Once the stage's model is saved: last.pt, prev.pt, last.dcp/, prev.dcp/ and their checksums go, with
    what a save cut short left behind (damaged ones moved aside stay, for inspection)."""
    for p in (path, path.with_name(PREV), path.with_name(LAST_DIR), path.with_name(PREV_DIR)):
        for f in (p, _sidecar(p)):
            if f.is_dir():
                shutil.rmtree(f)
            f.unlink(missing_ok=True)
            temp_name(f).unlink(missing_ok=True)
    shutil.rmtree(temp_name(path.with_name(LAST_DIR)), ignore_errors=True)


# -- sharded checkpoints (FSDP): a folder every rank writes its part of ---------------------------------

def _rank() -> tuple[int, int]:
    import torch.distributed as dist
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _folder_record(folder: Path) -> dict:
    """{file name: size and sha256} of every file in `folder`; each rank hashes a share (collective)."""
    rank, world = _rank()
    names = sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file())
    mine = {n: file_record(folder / n) for i, n in enumerate(names) if i % world == rank}
    return {k: v for part in all_gather(mine) for k, v in part.items()}


def _folder_files(folder: Path) -> dict | None:
    """The records written beside a checkpoint folder ({file name: size and sha256}), or None."""
    try:
        files = json.loads(_sidecar(folder).read_text())["files"]
        return {n: {"size": int(r["size"]), "sha256": str(r["sha256"])} for n, r in files.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _folder_damage(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder against its checksum file, or None (collective: each rank
    checks a share of the files; every rank gets the same answer)."""
    files = _folder_files(folder)
    if files is None:
        return (f"has no readable checksum file {_sidecar(folder).name} (its save was cut short, or an older "
                f"sparkchat wrote it)")
    rank, world = _rank()
    mine = None
    for i, (name, record) in enumerate(sorted(files.items())):
        problem = check_file(folder / name, record) if i % world == rank else None
        if problem:
            mine = f"{name} {problem}"
            break
    return next((p for p in all_gather(mine) if p), None)


def save_sharded(path: Path, model, optimizers: list, step: int, data_state: dict, fp: str, extra: dict) -> None:
    """Every rank calls this: writes the checkpoint folder `path` (last.dcp/); the one it replaces becomes
    prev.dcp/. As with a file, every moment of the sequence leaves one checkpoint that passes its check."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    rank, _ = _rank()
    tmp = temp_name(path)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizers)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)  # fsyncs every file it writes
    if rank == 0:
        state = {"step": step, "data": data_state, "rng": rng_state(), "fingerprint": fp, "extra": extra}
        write_atomic(tmp / TRAIN_STATE, lambda p: _torch_save(state, p))
    barrier()
    record = _folder_record(tmp)
    if rank == 0:
        prev, files = path.with_name(PREV_DIR), _folder_files(path)
        if path.exists() and files is not None:
            shutil.rmtree(prev, ignore_errors=True)
            _write_record(prev, {"files": files})  # prev.dcp fails its check until the rename; last.dcp passes
            os.replace(path, prev)  # now prev.dcp passes and last.dcp is absent
            fsync_dir(path.parent)
        elif path.exists():  # a last.dcp whose save never committed: nothing to keep
            shutil.rmtree(path)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        _write_record(path, {"files": record})  # last: the commit point
    barrier()


def load_sharded(path: Path, model, optimizers: list, fp: str) -> tuple[dict | None, str]:
    """Every rank calls this. Returns (train state, message): loads the newest intact checkpoint folder of
    this configuration (last.dcp/, then prev.dcp/) into `model` and `optimizers`, resharding to this run's
    rank count; (None, message) when there is none. Damaged folders are moved aside, never raised."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    notes = []
    for candidate in (path, path.with_name(PREV_DIR)):
        if not candidate.exists():
            continue
        problem, state = _folder_damage(candidate), None
        if problem is None:
            try:
                state = torch.load(candidate / TRAIN_STATE, map_location="cpu", weights_only=False)
            except Exception as e:
                problem = f"cannot be read ({type(e).__name__}: {e})"
        problem = next((p for p in all_gather(problem) if p), None)
        if problem:
            moved = broadcast(_move_aside(candidate) if _rank()[0] == 0 else None)
            notes.append(f"damaged checkpoint {candidate} {problem}; {moved}")
            continue
        if state.get("fingerprint") != fp:
            notes.append(f"checkpoint {candidate} is from a different configuration or inputs")
            continue
        model_sd, optim_sd = get_state_dict(model, optimizers)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=candidate)
        set_state_dict(model, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd)
        which = "" if candidate == path else f" of {candidate}"
        return state, "; ".join(notes + [f"resuming from checkpoint at step {state['step']}{which} "
                                         f"(sharded, on {_rank()[1]} rank(s))"])
    return None, "; ".join(notes) + "; starting from step 0" if notes else "no checkpoint: starting from step 0"
