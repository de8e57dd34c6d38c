"""What a test's copy of the project holds: the project's own files, never a virtual environment, caches
or artifacts.

The end-to-end tests run DVC in a copy of the project. Copying the checkout's folder wholesale took
whatever lay in it: a clone holding its virtual environment in `.venv` put 4.2 GB into every copy (42 GB
in one run, pytest keeping the last three). So a copy takes git's list instead: the tracked files, plus
new files that are not ignored inside folders git already tracks (a module written but not yet added).
A folder git does not track at all (a virtual environment under any name, a dataset) stays out, and so
does everything `.gitignore` names (caches, `artifacts/`, DVC's cache). Outside a git checkout (an
unpacked source archive) the copy takes the top-level entries in ALLOWED instead.

`dvc exp run -S key=value` rewrites params.yaml in the workspace (and a failed experiment leaves its value
there), so the tests read params.yaml as committed (`committed_text`), and a copy holds that version:
an experiment never breaks the tests, and the tests never run on an experiment's values.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

# files an experiment rewrites in the workspace (DVC's `-S`): tests read and copy them as committed
EXPERIMENT_FILES = ("params.yaml",)

# without git: what a project is, by top-level name (each folder copied without its __pycache__)
ALLOWED = (".dvc/config", ".dvc/plots", ".dvcignore", "Makefile", "dvc.yaml", "params.yaml", "pyproject.toml",
           "bench", "docs", "model", "pipeline", "profiles", "serve", "sparkchat", "tests")


def _git(root: Path, *args: str) -> list[str] | None:
    try:
        r = subprocess.run(["git", "-C", str(root), *args, "-z"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return [p for p in r.stdout.decode().split("\0") if p]


def project_files(root: Path) -> list[str] | None:
    """The project's files under `root`, relative to it (git's view, see above); None outside a checkout."""
    tracked = _git(root, "ls-files", "--cached")
    if tracked is None:
        return None
    # --directory: a wholly untracked folder is one entry ("venv/"), which is no file, so it stays out
    new = _git(root, "ls-files", "--others", "--exclude-standard", "--directory") or []
    return sorted(p for p in set(tracked + new) if (root / p).is_file())


def committed_text(root: Path, rel: str) -> str:
    """The file `rel` under `root` as git's HEAD holds it; the file itself outside a checkout (or before
    its first commit)."""
    try:
        r = subprocess.run(["git", "-C", str(root), "show", f"HEAD:./{rel}"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return (root / rel).read_text()
    return r.stdout.decode()


def copy_project(root: Path, dest: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """Copies the project at `root` to `dest` (project_files, or ALLOWED outside git), without the
    top-level entries in `leave_out`."""
    files = project_files(root)
    if files is None:
        for name in ALLOWED:
            if name.split("/")[0] not in leave_out and (root / name).exists():
                src, dst = root / name, dest / name
                dst.parent.mkdir(parents=True, exist_ok=True)
                if src.is_dir():
                    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(src, dst)
        return dest
    for rel in files:
        if rel.split("/")[0] in leave_out:
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel, follow_symlinks=False)
    for rel in EXPERIMENT_FILES:
        if rel in files and rel.split("/")[0] not in leave_out:
            (dest / rel).write_text(committed_text(root, rel))
    return dest


def committed_params(root: Path) -> dict:
    """params.yaml as committed, as a dict: an experiment's values in the workspace are not the defaults."""
    import yaml
    return yaml.safe_load(committed_text(root, "params.yaml"))


def run_on_params(root: Path, folder: Path, params: dict, *module_args: str,
                  timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m MODULE_ARGS` in `folder` with `params` as its params.yaml (the project's profiles linked
    beside it) and only the project on the path: what a stage or the CLI does with those values."""
    import yaml
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    if not (folder / "profiles").exists():
        (folder / "profiles").symlink_to(root / "profiles")
    return subprocess.run([sys.executable, "-m", *module_args], cwd=folder, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=timeout)
