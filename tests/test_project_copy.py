"""A test's copy of the project (tests/project_files.py) holds the project's files, never a virtual
environment or caches: in a git checkout, what git tracks plus new files beside them; elsewhere, the
allow-list."""
from __future__ import annotations

import subprocess
from pathlib import Path

from project_files import copy_project


def write(path: Path, text: str = "x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def a_checkout_with_venvs(root: Path) -> None:
    """A project with a `.venv` (ignored, as ours is), a `venv` (not ignored: a name .gitignore misses),
    caches, artifacts, a new module not yet added and a tracked file deleted from the working tree."""
    for name in ("model/gpt.py", "pipeline/train.py", "params.yaml", ".dvc/config", "tests/fixtures/a.jsonl",
                 "gone.py"):
        write(root / name)
    write(root / ".gitignore", "/.venv/\n__pycache__/\n/artifacts/\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    (root / "gone.py").unlink()
    for venv in (".venv", "venv"):
        write(root / venv / "pyvenv.cfg", "home = /usr/bin")
        write(root / venv / "lib" / "python3.11" / "site-packages" / "torch" / "lib.so", "0" * 1000)
    write(root / "model" / "__pycache__" / "gpt.cpython-311.pyc")
    write(root / "artifacts" / "model" / "model.safetensors")
    write(root / "model" / "new_module.py")  # written, not yet `git add`ed: the tests must see it


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_copy_takes_what_git_tracks_and_new_files_beside_them(tmp_path):
    src = tmp_path / "clone"
    a_checkout_with_venvs(src)
    got = files_under(copy_project(src, tmp_path / "copy", leave_out=("tests",)))
    assert got == [".dvc/config", ".gitignore", "model/gpt.py", "model/new_module.py", "params.yaml",
                   "pipeline/train.py"], got


def test_outside_git_a_copy_takes_the_allow_list(tmp_path):
    src = tmp_path / "unpacked"
    for name in ("model/gpt.py", "model/__pycache__/gpt.cpython-311.pyc", "params.yaml", ".venv/pyvenv.cfg",
                 "venv/lib/torch.so", "artifacts/data/x.parquet", ".dvc/config", ".dvc/cache/files/md5/ab/cd"):
        write(src / name)
    assert subprocess.run(["git", "-C", str(src), "rev-parse"], capture_output=True).returncode != 0
    assert files_under(copy_project(src, tmp_path / "copy")) == [".dvc/config", "model/gpt.py", "params.yaml"]


def test_a_copy_holds_params_yaml_as_committed_not_an_experiments_values(tmp_path):
    """`dvc exp run -S` rewrites params.yaml in the workspace (DVC's own rewrite, run here) and a failed
    experiment leaves its value there: the tests' copy and their reading of params.yaml take the commit's."""
    from dvc.utils.hydra import apply_overrides

    from project_files import committed_text

    src = tmp_path / "clone"
    write(src / "params.yaml", "model:\n  depth: 4\n")
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "params"], check=True)
    apply_overrides(str(src / "params.yaml"), ["model.depth=abc"])
    assert "depth: abc" in (src / "params.yaml").read_text()
    assert committed_text(src, "params.yaml") == "model:\n  depth: 4\n"
    assert (copy_project(src, tmp_path / "copy") / "params.yaml").read_text() == "model:\n  depth: 4\n"
