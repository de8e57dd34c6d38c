"""The portable model directory: what the pipeline exports and the server (or any tool) loads.

    config.json        GPTConfig as JSON: the model is rebuilt from this alone
    model.safetensors  weights in float32, whatever precision backend trained them
    tokenizer.json     the `tokenizers` file with the chat special tokens
    generation.json    sampling defaults and whether the model was trained to call the calculator

No DVC, no Transformer Engine and no training params are needed to load it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .gpt import GPT, GPTConfig
from .tokenizer import SparkTokenizer

DEFAULT_GENERATION = {"temperature": 0.7, "top_k": 50, "top_p": 1.0, "max_tokens": 256, "tool_use": True}


def portable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """float32 copy of the weights under the plain GPT's names (backends may add extra state)."""
    sd = model.state_dict()
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("_orig_mod.").removeprefix("module.")
        if k.endswith("_extra_state") or not isinstance(v, torch.Tensor):
            continue
        out[k] = v.detach().to("cpu", torch.float32).contiguous()
    return out


def upgrade_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model directories written before q, k and v were fused hold `c_q`, `c_k`, `c_v`: join them."""
    for key in [k for k in sd if k.endswith("attn.c_q.weight")]:
        prefix = key.removesuffix("c_q.weight")
        sd[prefix + "c_qkv.weight"] = torch.cat([sd.pop(prefix + n + ".weight") for n in ("c_q", "c_k", "c_v")])
    return sd


def save_model_dir(path: str | Path, model: GPT, tokenizer: SparkTokenizer, generation: dict | None = None,
                   extra: dict | None = None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(portable_state_dict(model), str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(path / "tokenizer.json")
    gen = {**DEFAULT_GENERATION, **(generation or {})}
    (path / "generation.json").write_text(json.dumps(gen, indent=2) + "\n")
    if extra:
        (path / "meta.json").write_text(json.dumps(extra, indent=2) + "\n")


def load_model_dir(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Returns (model in eval mode, tokenizer, generation defaults)."""
    path = Path(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a sparkchat model directory: {name} is missing")
    config = GPTConfig(**json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    cos, sin = model._rope_tables(model.rope_len)
    model.cos, model.sin = cos.to(device), sin.to(device)
    model.load_state_dict(upgrade_state_dict(load_file(str(path / "model.safetensors"), device=str(device))),
                          strict=True)
    model.to(dtype).eval()
    gen = dict(DEFAULT_GENERATION)
    if (path / "generation.json").is_file():
        gen.update(json.loads((path / "generation.json").read_text()))
    return model, SparkTokenizer.load(path / "tokenizer.json"), gen
