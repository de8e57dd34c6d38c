"""Metrics and plots in the plain formats `dvc metrics show` and `dvc plots show` read (JSON, TSV).

Files are replaced atomically so an interrupted stage never leaves half a metrics file."""
from __future__ import annotations

import json
import os
from pathlib import Path

from sparkchat import paths

# each training stage's validation bits per byte, named for the data it is measured on: the held-out
# pretraining text, every token of the held-out conversations, and only the assistant's replies in them (the
# tokens SFT learns)
VAL_BPB = {"pretrain": "val_bpb_text", "midtrain": "val_bpb_chat", "sft": "val_bpb_replies"}


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
    except BaseException:  # a partial file would only hold on to the space that ran out
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def write_json(path: str | Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_reports(stage: str, headline: dict | None = None, details: dict | None = None,
                  timings: dict | None = None) -> None:
    """A stage's reports (sparkchat/paths.py), those it has: its headline metrics, the rest of what its inputs
    decide, and its timings (git-ignored)."""
    if headline is not None:
        write_json(paths.metrics_file(stage), headline)
    if details is not None:
        write_json(paths.details_file(stage), details)
    if timings is not None:
        write_json(paths.timings_file(stage), timings)


class TSVLog:
    """A TSV plot file: one header, one row per `log` call. `rows` holds the rows logged so far (a
    resumed stage passes the rows its checkpoint carried); the list grows as rows are logged, so the
    caller can save it with the next checkpoint."""

    def __init__(self, path: str | Path, columns: list[str], rows: list[str] | None = None):
        self.path, self.columns = Path(path), columns
        self.rows = rows if rows is not None else []
        atomic_write_text(self.path, "\n".join(["\t".join(columns)] + self.rows) + "\n")

    def log(self, **values) -> None:
        line = "\t".join(_fmt(values.get(c, "")) for c in self.columns)
        self.rows.append(line)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
