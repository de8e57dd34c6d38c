"""What a model directory says about its model, read without loading it or torch (model/model_dir.py
says what the directory holds): for a page to show, and the sampling defaults a directory's
generation.json fills in."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

# generation.json's values where it leaves one out
DEFAULT_GENERATION = {"temperature": 0.7, "top_k": 50, "top_p": 1.0, "max_tokens": 256, "tool_use": True}


def describe_model_dir(path: str | Path) -> dict:
    """What a model directory says about its model, without loading the weights (for a page to show):
    `config` (config.json), `generation` (generation.json over the defaults) and `meta` (meta.json); a
    file that is missing or unreadable gives {} (loading the model is what names a damaged directory)."""
    def read(name: str) -> dict:
        try:
            data = json.loads((Path(path) / name).read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}
    config = read("config.json")
    if "model_type" in config:  # a transformers directory: its config in sparkchat's terms (loads torch)
        from .hf import gpt_config, read_hf_config
        from .model_dir import ModelDirError
        try:
            config = asdict(gpt_config(read_hf_config(Path(path))))
        except (ModelDirError, OSError, ValueError):
            config = {}
    return {"config": config, "generation": {**DEFAULT_GENERATION, **read("generation.json")},
            "meta": read("meta.json")}
