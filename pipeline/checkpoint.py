"""Training checkpoints: model, optimizer, data position, RNG, written atomically, resumed safely.

A checkpoint carries a fingerprint of everything the run depends on (the stage's params, the model
shape, the input files' hashes). A stage only resumes a checkpoint whose fingerprint matches, so a
changed parameter starts fresh instead of continuing a different run.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import torch

from model.model_dir import portable_state_dict


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in paths:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
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


def save_checkpoint(path: Path, model, optimizer, step: int, data_state: dict, fp: str, extra: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": portable_state_dict(model), "optimizer": optimizer.state_dict(), "step": step,
                "data": data_state, "rng": rng_state(), "fingerprint": fp, "extra": extra}, tmp)
    os.replace(tmp, path)  # atomic: a kill leaves either the old or the new checkpoint, never half of one


def load_checkpoint(path: Path, fp: str) -> tuple[dict | None, str]:
    """Returns (checkpoint, message). None when absent or made by a different configuration."""
    if not path.exists():
        return None, "no checkpoint: starting from step 0"
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if ckpt.get("fingerprint") != fp:
        return None, "checkpoint is from a different configuration or inputs: starting from step 0"
    return ckpt, f"resuming from checkpoint at step {ckpt['step']}"
