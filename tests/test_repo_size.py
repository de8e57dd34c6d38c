"""What git holds stays small: no large file is added (a model, a dataset or a long raw run belongs in
DVC's storage), and raw benchmark results stay a minority of the tree's lines, so that `git grep` finds
code and pages rather than logs."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.project_files import project_files

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_BYTES = 512 * 1024  # the largest tracked file is a tenth of this (captures are capped at 300 kB)
RAW = "bench/results/"


@pytest.fixture(scope="module")
def files() -> list[str]:
    found = project_files(ROOT)
    if found is None:
        pytest.skip("not a git checkout: git's list of files is what this checks")
    return found


def large_files(root: Path, names: list[str], limit: int = MAX_FILE_BYTES) -> list[str]:
    return [f"{n}: {(root / n).stat().st_size:,} bytes" for n in names if (root / n).stat().st_size > limit]


def test_no_large_file_is_added_to_git(files):
    big = large_files(ROOT, files)
    assert not big, (f"files over {MAX_FILE_BYTES:,} bytes: {big}; track them with DVC (`dvc add`), or trim "
                     f"a raw run to what its page needs")


def test_the_guard_sees_a_large_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0" * (MAX_FILE_BYTES + 1))
    (tmp_path / "small.txt").write_text("x")
    assert large_files(tmp_path, ["model.bin", "small.txt"]) == [f"model.bin: {MAX_FILE_BYTES + 1:,} bytes"]


def test_raw_results_are_a_minority_of_the_lines(files):
    def lines(name: str) -> int:
        try:
            return (ROOT / name).read_bytes().count(b"\n")
        except OSError:
            return 0
    raw = sum(lines(n) for n in files if n.startswith(RAW) and n.count("/") > 2)  # an area's folder
    total = sum(lines(n) for n in files)
    assert raw < total / 2, f"raw results are {raw:,} of the tree's {total:,} lines"
