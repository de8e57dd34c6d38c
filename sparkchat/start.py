"""What `sparkchat serve` and `sparkchat chat` check before they import anything heavy, so that a clone
with nothing trained hears what to do within a second instead of after torch has loaded. Not in paths.py:
every pipeline stage depends on that file, and this is no stage's business."""
from __future__ import annotations

from pathlib import Path

from .paths import CHAT_MODEL


def missing_model(path) -> str | None:
    """What to do when the model directory `path` is not there (None when it is). Whether a directory
    that is there holds a model is model.model_dir's to say, after torch has loaded."""
    path = Path(path)
    if path.is_dir():
        return None
    where = f"{path}" if path.is_absolute() else f"{path} (in {Path.cwd()})"
    if path.exists():
        return f"the model directory {where} is a file, not a directory: pass --model DIR"
    if path == CHAT_MODEL:
        return (f"no model at {where} yet: train the default chat model with `make repro` (from the project's "
                f"root), or pass --model DIR (a sparkchat model directory, or a Hugging Face NanoChat one)")
    return (f"the model directory {where} does not exist: pass --model the path of one (`make repro` trains "
            f"the default into {CHAT_MODEL})")
