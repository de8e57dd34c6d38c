"""A full disk while `prepare` or `sparkchat export` writes: one line naming what could not be written and
the space left, no traceback, and nothing partial left behind to hold on to the space.

The disk is one that really fills: a small tmpfs mounted over the output folder where this process may
mount one (root), so the writers meet ENOSPC; elsewhere a file-size limit (RLIMIT_FSIZE, `ulimit -f`),
which the kernel enforces with EFBIG, the same path through the code.
"""
from __future__ import annotations

import contextlib
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from project_files import committed_text

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def small_disk(folder: Path, size: int, tmpfs_only: bool = False):
    """`folder` on a filesystem of `size` bytes; yields the preexec_fn a writer runs under (None: the tmpfs
    alone limits it, else a file-size limit of `size` stands in)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    if not mounted and tmpfs_only:
        pytest.skip("needs a small tmpfs (mount, as root): a per-file size limit does not fill this disk")
    try:
        yield None if mounted else (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size)))
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def env() -> dict:
    return {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


# 1 MiB: the first pretraining shard (about 2 MiB) does not fit; 3 MiB: the shards and held-out items fit,
# and the conversations (datasets' parquet writer) do not
@pytest.mark.parametrize("size, tmpfs_only", [(1 << 20, False), (3 << 20, True)], ids=["shards", "conversations"])
def test_prepare_on_a_full_disk_says_so_in_one_line_and_leaves_no_data(tmp_path, size, tmpfs_only):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "params.yaml").write_text(committed_text(ROOT, "params.yaml"))
    (proj / "profiles").symlink_to(ROOT / "profiles")
    with small_disk(proj / "artifacts", size, tmpfs_only) as limit:
        r = subprocess.run([sys.executable, "-m", "pipeline.prepare"], cwd=proj, env=env(), capture_output=True,
                           text=True, timeout=600, preexec_fn=limit)
        left = files_under(proj / "artifacts")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"prepare: cannot write artifacts/data: (no space left on the device|the file size limit "
                        r"of this process \(`ulimit -f`\) reached); [\d.]+ \S+ free on the filesystem holding "
                        r"artifacts\. Free some space and run it again", last), last
    assert left == [], left
    assert not (proj / "reports").exists()


def test_export_on_a_full_disk_says_so_in_one_line_and_leaves_no_directory(serve_model_dir, tmp_path):
    disk = tmp_path / "disk"
    with small_disk(disk, 64 << 10) as limit:  # the tiny model's weights alone are over 64 KiB
        r = subprocess.run([sys.executable, "-m", "pipeline.export", "--model", str(serve_model_dir),
                            "--out", str(disk / "hf")], cwd=tmp_path, env=env(), capture_output=True, text=True,
                           timeout=300, preexec_fn=limit)
        left = files_under(disk)
        dirs = sorted(p.name for p in disk.iterdir())
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().count("\n") == 0, r.stderr  # one line
    assert re.fullmatch(rf"export: cannot write {re.escape(str(disk / 'hf'))}: (no space left on the device|the "
                        rf"file size limit of this process \(`ulimit -f`\) reached); [\d.]+ \S+ free on the "
                        rf"filesystem holding {re.escape(str(disk))}\. Free some space and run it again",
                        r.stderr.strip()), r.stderr
    assert left == [] and dirs == [], (left, dirs)
