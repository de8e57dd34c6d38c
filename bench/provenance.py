"""What ran: the record `bench.stats.save_json` puts in every raw result file, under `provenance`.

A page's figure is only as good as the knowledge of which code, machine and command produced it, so the
benchmark writes that itself instead of leaving it to the prose beside the table:

- `commit`: the git commit the code is at, when the tree is a clean checkout of it; None otherwise.
- `base_commit` and `dirty`: HEAD and whether tracked files differ from it (None, None outside git: a
  GPU host often gets a copy of the working tree without its history).
- `tree_hash`: a sha256 over the path and content of every code file (`CODE_SUFFIXES`), the same with
  or without git, so a dirty or exported tree still names exactly what ran.
- `command`, `date` (UTC), `host` (CPU model, CPU count), `gpus`, and the versions of Python, torch and
  CUDA.

`FIELDS` are the keys every raw JSON file under bench/results must carry (`tests/test_results_pages.py`).
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import os
import platform
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("commit", "base_commit", "dirty", "tree_hash", "command", "date", "host", "gpus", "versions")
# The files that decide what a benchmark runs: code and its configuration, not results or docs.
CODE_SUFFIXES = (".py", ".yaml", ".toml", ".sh", ".cfg", ".txt")
SKIP_DIRS = {"results", "artifacts", "reports", "node_modules", "__pycache__", "dvc_plots", "peers"}  # peers: bench/peers, git-ignored


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def _own_git_tree() -> bool:
    """Whether ROOT is the top of a git work tree (not a copy sitting inside another repository)."""
    top = _git("rev-parse", "--show-toplevel")
    return top is not None and Path(top.strip()).resolve() == ROOT


def code_files(use_git: bool) -> list[str]:
    """The code files' paths relative to ROOT, sorted: git's tracked and unignored files, or a walk of
    the folder that skips hidden folders, virtual environments and outputs (the same set on a clean copy)."""
    if use_git:
        listed = _git("ls-files", "--cached", "--others", "--exclude-standard") or ""
        paths = [p for p in listed.splitlines() if (ROOT / p).is_file()]
    else:
        paths = []
        for d, dirs, files in os.walk(ROOT):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x not in SKIP_DIRS and not x.endswith(".egg-info")
                       and not (Path(d) / x / "pyvenv.cfg").exists()]
            paths += [os.path.relpath(os.path.join(d, f), ROOT) for f in files]
    keep = [p for p in paths if p.endswith(CODE_SUFFIXES) and not set(Path(p).parts[:-1]) & SKIP_DIRS]
    return sorted(p.replace(os.sep, "/") for p in keep)


def tree_hash(use_git: bool) -> str:
    h = hashlib.sha256()
    for p in code_files(use_git):
        h.update(p.encode() + b"\0" + hashlib.sha256((ROOT / p).read_bytes()).digest())
    return h.hexdigest()


def command_line() -> str:
    """This process's command as typed: `python -m pkg.mod ARGS` for a module, else the script's path."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None and spec.name != "__main__" else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def _static() -> dict:
    # Computed once a process: a benchmark saves its partial results several times in a run.
    own = _own_git_tree()
    head = (_git("rev-parse", "HEAD") or "").strip() or None if own else None
    dirty = bool((_git("status", "--porcelain", "--untracked-files=no") or "").strip()) if head else None
    versions = {"python": platform.python_version(), "torch": None, "cuda": None}
    gpus: list[str] = []
    try:
        import torch
        versions.update(torch=torch.__version__, cuda=torch.version.cuda)
        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return {"commit": head if head and not dirty else None, "base_commit": head, "dirty": dirty,
            "tree_hash": tree_hash(own), "command": command_line(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform()},
            "gpus": gpus, "versions": versions}


def provenance() -> dict:
    """The record described at the top of this module (the date: this process's first call)."""
    return copy.deepcopy(_static())


def run_id() -> str:
    """One string naming the code that ran: the commit when the tree is clean, else the content hash of
    the tree (and the commit it is based on, when known)."""
    p = _static()
    if p["commit"]:
        return p["commit"]
    return f"{p['base_commit'] + '+' if p['base_commit'] else ''}tree:{p['tree_hash'][:16]}"
