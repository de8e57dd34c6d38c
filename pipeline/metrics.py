"""Metrics and plots in the plain formats `dvc metrics show` and `dvc plots show` read (JSON, TSV).

Files are replaced atomically so an interrupted stage never leaves half a metrics file."""
from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: str | Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


class TSVLog:
    """Append-only TSV plot file (one header, one row per call). On resume, rows past `keep_until_step`
    are dropped so the plot has no duplicate steps."""

    def __init__(self, path: str | Path, columns: list[str], resume_step: int | None = None):
        self.path, self.columns = Path(path), columns
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows = []
        if resume_step is not None and self.path.exists():
            lines = self.path.read_text().splitlines()
            if lines and lines[0].split("\t") == columns:
                rows = [ln for ln in lines[1:] if ln and int(float(ln.split("\t")[0])) <= resume_step]
        atomic_write_text(self.path, "\n".join(["\t".join(columns)] + rows) + "\n")

    def log(self, **values) -> None:
        with open(self.path, "a") as f:
            f.write("\t".join(_fmt(values.get(c, "")) for c in self.columns) + "\n")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
