"""The skeleton every training stage shares (pretrain, midtrain and SFT in pipeline/train.py, rl in
pipeline/rl.py); what differs between them, the model they build and the steps they take, stays there.

  - `stage_main`: the command-line entry: params loaded and checked, the backend checked before any work,
    the stage launched (under torchrun when `runtime.nproc` > 1), its errors said in one line;
  - `start`: the device, the precision backend and the process group (a rank `sparkchat join` started
    learns its stage from global rank 0);
  - `setup_stage`: threads, this rank's seed, the checkpoint folder (checked to be one folder on every rank);
  - `load_state` and `save_state`: the resume branch and the checkpoint, a file on rank 0 or a folder of
    shards under FSDP;
  - `finish_stage`: the model directory, the reports, the checkpoints removed, the process group ended.
"""
from __future__ import annotations

import secrets
import socket
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from model.model_dir import ModelDirError, NoRoomError, save_model_dir
from model.parallel import all_gather, broadcast, full_state_dict
from model.precision import get_backend
from sparkchat import paths

from .checkpoint import (LAST_DIR, load_checkpoint, load_sharded, remove_checkpoints, save_checkpoint, save_sharded,
                         set_rng_state)
from .config import ConfigError, Params, load_params
from .data import DataError
from .metrics import write_reports
from .runtime import LaunchError, launch, log, resolve_device, setup_distributed

CHECKPOINT_NOTE = ("This stage's checkpoints while it runs (last.pt, prev.pt, each with its .sha256; under FSDP the "
                   "folders last.dcp, prev.dcp). A killed stage resumes from them on the next `dvc repro`; a finished "
                   "one removes them.\n")


def stage_main(stage: str, body: Callable[[Params], dict], errors: tuple = (),
               skip: Callable[[Params], bool] | None = None) -> None:
    """Runs `body(params)` as the stage `stage` (relaunched under torchrun when `runtime.nproc` > 1), unless
    `skip(params)` says it has done the stage another way. A bad value, a backend that cannot run here or a
    missing input stops it with one line naming the stage; `errors`: more exceptions said that way."""
    from model.precision import BackendUnavailable
    try:
        p = load_params(stage=stage)
        if skip is not None and skip(p):
            return
        stage_backend(stage, p)
        launch(p.runtime, f"pipeline.{stage}", lambda: body(p))
    except (ConfigError, BackendUnavailable, ModelDirError, DataError, LaunchError, *errors) as e:
        raise SystemExit(f"{stage}: {e}") from None
    except NoRoomError as e:  # what was written before stays: the next run resumes from the last checkpoint
        raise SystemExit(f"{stage}: {e}. Free some space and run it again: it resumes from its last complete "
                         f"checkpoint") from None


def stage_backend(stage: str, p: Params):
    """The stage's precision backend, refusing a `runtime.parallel` it cannot run under (checked again in
    every rank, and first by the process that relaunches under torchrun: one message, not one per rank)."""
    pr = p.precision
    name = p.backend_for(stage)
    backend = get_backend(name, pr.options_for(name), pr.layer_filter)
    backend.check_parallel(p.runtime.parallel)
    return backend


def start(stage: str | None, p: Params):
    """The device, the precision backend (checked before any work: a refusal costs nothing) and the process
    group. Returns (stage, params, backend, device, rank, world): with stage None (a rank `sparkchat join`
    started) the stage global rank 0 runs, and its params."""
    device = resolve_device(p.runtime.device)
    backend = stage_backend(stage, p) if stage else None
    if backend:
        backend.check(device)  # fail before any work
    # FSDP shards over a process group even on one rank (its checkpoints then load on any number)
    rank, world, device = setup_distributed(device, p.runtime.timeout_s, always=p.runtime.parallel == "fsdp")
    if world > 1:  # rank 0 says which stage runs: a joining rank takes it, a rank started for another stops
        leader = broadcast(stage)
        if stage is None:
            stage, p = leader, load_params(stage=leader)
            backend = stage_backend(stage, p)
            backend.check(device)
        elif leader != stage:
            raise LaunchError(f"global rank 0 runs the {leader} stage, but this machine started {stage}")
    backend.check_parallel(p.runtime.parallel)  # auto knows its backend now
    return stage, p, backend, device, rank, world


def check_shared_folder(folder: Path, rank: int) -> None:
    """Every rank must see the files rank 0 writes (checkpoints, and the outputs the next stage reads):
    on several machines, the project directory must be on a filesystem they all mount. Fails on every
    rank, naming the machines that do not see it, instead of a hang or a half-written checkpoint."""
    token, where = broadcast((secrets.token_hex(8), str(folder.resolve())) if rank == 0 else None)
    probe = folder / ".rank0"
    if rank == 0:
        probe.write_text(token)
    all_gather(None)  # a barrier: rank 0's file is written
    seen = probe.is_file() and probe.read_text() == token
    blind = sorted({host for ok, host in all_gather((seen, socket.gethostname())) if not ok})
    if rank == 0:  # every rank has looked (the gather above)
        probe.unlink()
    if blind:
        raise LaunchError(f"{', '.join(blind)} cannot see the files rank 0 writes in {where}: a job on "
                          f"several machines needs the project directory on a filesystem every machine mounts at "
                          f"the same path (README, \"Several machines\")")


def setup_stage(stage: str, p: Params, seed: int, rank: int, world: int) -> Path:
    """What every training stage does first: torch's threads and this rank's seed, and the stage's
    checkpoint folder, made and checked to be the same folder on every rank. Returns the folder."""
    if p.runtime.threads:
        torch.set_num_threads(p.runtime.threads)
    torch.manual_seed(seed + rank)
    ckpt_dir = paths.checkpoint_dir(stage)
    # a DVC output whether or not a checkpoint is written; the note keeps it from being an empty
    # folder (which DVC warns about) once a finished stage has removed its checkpoints
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (ckpt_dir / "README.txt").write_text(CHECKPOINT_NOTE)
    if world > 1:
        check_shared_folder(ckpt_dir, rank)
    return ckpt_dir


def checkpoint_path(stage: str) -> Path:
    """The stage's checkpoint: this file on rank 0, or under FSDP the folder beside it (LAST_DIR)."""
    return paths.checkpoint_dir(stage) / "last.pt"


def load_state(stage: str, sharded: bool, model, optimizer, fp: str) -> dict | None:
    """The stage's checkpoint when one matches the fingerprint `fp`, loaded into `model` and `optimizer` and
    the random generators; returns its state (`step`, `data`, `extra`), or None to start from step 0."""
    path = checkpoint_path(stage)
    if sharded:
        state, msg = load_sharded(path.with_name(LAST_DIR), model, optimizer.optimizers, fp)
    else:
        state, msg = load_checkpoint(path, fp)
        if state is not None and any(k.endswith("attn.c_q.weight") for k in state["model"]):
            state, msg = None, f"{path} is from before q, k and v were fused into one projection: starting from step 0"
        if state is not None:
            model.load_state_dict(state["model"], strict=False)
            optimizer.load_state_dict(state["optimizer"])
    log(f"{stage}: {msg}")
    if state is not None:
        set_rng_state(state["rng"])
    return state


def save_state(stage: str, sharded: bool, rank: int, model, optimizer, done: int, data_state: dict, fp: str,
               history: dict) -> None:
    """A checkpoint after step `done`: every rank writes its shards under FSDP, rank 0 the whole otherwise."""
    path = checkpoint_path(stage)
    if sharded:
        save_sharded(path.with_name(LAST_DIR), model, optimizer.optimizers, done, data_state, fp, history)
    elif rank == 0:
        save_checkpoint(path, model, optimizer, done, data_state, fp, history)


def finish_stage(stage: str, sharded: bool, rank: int, model, out_dir: Path, tok, extra: dict,
                 reports: tuple[dict, dict, dict], done: str, generation: dict | None = None) -> None:
    """The model directory at `out_dir` (`extra` into its meta.json), the reports (headline, details,
    timings: pipeline/metrics.py), the checkpoints removed, `done` logged, and the process group ended."""
    weights = full_state_dict(model) if sharded else None  # gathered onto rank 0 (every rank takes part)
    if rank == 0:
        save_model_dir(out_dir, model, tok, generation=generation, extra=extra, state_dict=weights)
        write_reports(stage, *reports)
        # the checkpoint only recovers an interrupted run; once the model is saved it goes, so a re-run
        # caused by a code change (not in the fingerprint) starts from step 0 rather than resuming
        remove_checkpoints(checkpoint_path(stage))
        log(done)
    if dist.is_initialized():
        dist.destroy_process_group()
