"""Every precision backend's options, declared once: one typed dataclass per backend, with defaults,
allowed values (`Literal[...]`) and a docstring per field (torchtitan's float8 converter `Config`).

params.yaml's `precision:` section holds one block per dataclass under the name in its `KEY`
(`precision.fp8`, `precision.te_fp8`, ...); `pipeline/config.py` builds those blocks into these types,
the probe builds them from entries such as `fp8:scaling=delayed`, and each backend receives one. The
dataclass checks itself on construction, so a bad value fails wherever it came from, with an
`OptionError` naming the full key (`precision.fp8.scaling must be one of dynamic, delayed; got 'lazy'`).

Deliberately free of torch, so the configuration and the command line's `--help` load quickly.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Mapping


class OptionError(ValueError):
    """A bad backend option; the message names its key (e.g. precision.fp8.scaling)."""


def choices(tp) -> tuple:
    """The allowed values of a Literal type, e.g. choices(TERecipe) == ('delayed', 'current', ...)."""
    return typing.get_args(tp)


@dataclass
class Options:
    """Base of the option dataclasses: checks types and allowed values of every field on construction,
    then each `MINIMUM` bound."""
    KEY: ClassVar[str] = ""
    """Where params.yaml holds these options, e.g. 'precision.fp8'."""
    MINIMUM: ClassVar[dict[str, float]] = {}
    """field -> the smallest value it may take."""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _checked(getattr(self, f.name), hints[f.name], f"{self.KEY}.{f.name}"))
        for name, low in self.MINIMUM.items():
            if getattr(self, name) < low:
                raise OptionError(f"{self.KEY}.{name} must be >= {low}, got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, base: "Options | None" = None):
        """These options from a params block (a mapping of field -> value), over `base` if given."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise OptionError(f"{cls.KEY} must be a mapping, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise OptionError(f"unknown key '{cls.KEY}.{unknown[0]}' (known keys: {', '.join(names)})")
        return dataclasses.replace(base, **data) if base is not None else cls(**data)

    @classmethod
    def parse(cls, pairs: Mapping[str, str]):
        """These options from text values (`key=value` on a command line), each read as its field's type."""
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        typed = {}
        for k, text in pairs.items():
            if k not in names:
                raise OptionError(f"unknown key '{cls.KEY}.{k}' (known keys: {', '.join(names)})")
            typed[k] = _from_text(text, hints[k], f"{cls.KEY}.{k}")
        return cls(**typed)

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what a label or a probe row records)."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


def _checked(value, tp, key):
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise OptionError(f"{key} must be one of {', '.join(map(str, typing.get_args(tp)))}; got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise OptionError(f"{key} must be a list, got {value!r}")
        return [_checked(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool and not isinstance(value, bool):
        raise OptionError(f"{key} must be true or false, got {value!r}")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise OptionError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise OptionError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str and not isinstance(value, str):
        raise OptionError(f"{key} must be a string, got {value!r}")
    return value


def _from_text(text: str, tp, key):
    if tp is bool:
        if text not in ("true", "false"):
            raise OptionError(f"{key} must be true or false, got {text!r}")
        return text == "true"
    try:
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
    except ValueError:
        raise OptionError(f"{key} must be {'an integer' if tp is int else 'a number'}, got {text!r}") from None
    if typing.get_origin(tp) is list:  # a list on one line: a+b
        return [s for s in text.split("+") if s]
    return text


# -- the backends' options ----------------------------------------------------------------------------

TERecipe = Literal["delayed", "current", "block", "mxfp8"]


@dataclass
class Fp8Options(Options):
    """`fp8`: native FP8 GEMMs through torch._scaled_mm (fp8.py explains each choice)."""
    KEY: ClassVar[str] = "precision.fp8"
    MINIMUM: ClassVar[dict[str, float]] = {"amax_history_len": 1}
    fast_accum: Literal["forward", "all", "none"] = "forward"
    """_scaled_mm's fast accumulation: forward (the forward GEMM only) | all | none."""
    scaling: Literal["dynamic", "delayed"] = "dynamic"
    """dynamic: each tensor by its own amax | delayed: activations and gradients by the largest amax of
    the last `amax_history_len` steps (TE's DelayedScaling); weights stay dynamic."""
    amax_history_len: int = 16
    """Delayed scaling: how many steps of amax the scale looks back over."""
    cast: Literal["kernel", "inline"] = "kernel"
    """kernel: one cast-transpose op per tensor (Triton on CUDA) | inline: casts left to torch.compile."""
    mlp: Literal["fused", "linear"] = "fused"
    """fused (with cast: kernel): each relu^2 MLP as one Function, its activation inside the casts |
    linear: two FP8 Linears."""
    pow2_scales: bool = True
    """Scales rounded down to powers of two (with dynamic scaling and cast: kernel no amax pass runs
    first) | false: scale = max / amax exactly."""



@dataclass
class TEFp8Options(Options):
    """`te-fp8`: Transformer Engine's FP8 modules under one of its recipes (te_fp8.py)."""
    KEY: ClassVar[str] = "precision.te_fp8"
    MINIMUM: ClassVar[dict[str, float]] = {"amax_history_len": 1}
    recipe: TERecipe = "delayed"
    """delayed (amax history) | current (this step's amax) | block (1x128 / 128x128 blocks, sm_90+) |
    mxfp8 (1x32 blocks, power-of-two scales, sm_100+)."""
    modules: Literal["fused", "linear"] = "fused"
    """fused: each MLP one te.LayerNormMLP, te.Linear elsewhere | linear: te.Linear everywhere."""
    amax_history_len: int = 16
    """recipe delayed: steps of amax history."""
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    """recipe delayed: the scale from the history's largest amax, or from the most recent one."""
    compile: bool = True
    """Compile the model block by block around the (eager) TE modules; false: all eager."""



@dataclass
class Nvfp4Options(Options):
    """`te-nvfp4` and `nvfp4-emulated`: the NVFP4 training recipe, defaults as TE and the NVFP4 paper
    (arXiv 2509.25149) recommend."""
    KEY: ClassVar[str] = "precision.nvfp4"
    MINIMUM: ClassVar[dict[str, float]] = {"bf16_last_blocks": 0}
    weight_2d: bool = True
    """16x16 block scales for weights, so W and W^T quantise alike."""
    stochastic_rounding: bool = True
    """Stochastic rounding of gradients."""
    rht: bool = True
    """Random Hadamard transform on the weight-gradient GEMM's inputs."""
    bf16_last_blocks: int = 2
    """Final transformer blocks kept in BF16 (the head always is)."""



@dataclass
class AutoOptions(Options):
    """`auto`: the fastest backend a probe on this machine measured (auto.py)."""
    KEY: ClassVar[str] = "precision.auto"
    MINIMUM: ClassVar[dict[str, float]] = {"max_loss_diff_pct": 0}
    probe_file: str = ""
    """probe.json to pick from; '' = the probe stage's output (the pipeline fills in its path)."""
    max_loss_diff_pct: float = 1.0
    """A backend whose probe loss is further than this (percent) from bf16's is never picked."""



@dataclass
class LayerFilter(Options):
    """Which Linear layers a backend converts. FP8/FP4 GEMMs need dims divisible by 16; the output head
    (and embeddings, which are not Linears) stay in higher precision by default."""
    KEY: ClassVar[str] = "precision.layer_filter"
    MINIMUM: ClassVar[dict[str, float]] = {"dim_multiple": 1}
    dim_multiple: int = 16
    """Only Linear layers whose dims are multiples of this convert (FP8/FP4 GEMM requirement)."""
    skip: list[str] = field(default_factory=lambda: ["lm_head"])
    """Layer names (substrings) that stay in high precision."""


    def __call__(self, fqn: str, module) -> bool:
        import torch.nn as nn  # here, so this module loads without torch
        if not isinstance(module, nn.Linear) or getattr(module, "is_low_precision", False):
            return False
        if any(s and s in fqn for s in self.skip):
            return False
        return module.in_features % self.dim_multiple == 0 and module.out_features % self.dim_multiple == 0


# Every backend name (params `precision.backend`) and the options it takes (None: none).
BACKEND_OPTIONS: dict[str, type[Options] | None] = {
    "bf16": None, "fp8": Fp8Options, "te-fp8": TEFp8Options, "te-nvfp4": Nvfp4Options,
    "fp8-emulated": None, "nvfp4-emulated": Nvfp4Options, "auto": AutoOptions,
}
BACKEND_NAMES = tuple(BACKEND_OPTIONS)


def options_for(name: str, data: Mapping[str, Any] | Options | None = None) -> Options | None:
    """Backend `name`'s typed options: from a mapping of its fields (or none: the defaults), or checked
    to be of its type when already typed."""
    if name not in BACKEND_OPTIONS:
        raise OptionError(f"unknown precision backend '{name}'; choose one of {', '.join(BACKEND_NAMES)}")
    cls = BACKEND_OPTIONS[name]
    if cls is None:
        if data:
            raise OptionError(f"precision backend '{name}' takes no options, got {data!r}")
        return None
    if isinstance(data, Options):
        if not isinstance(data, cls):
            raise OptionError(f"precision backend '{name}' takes {cls.__name__}, got {type(data).__name__}")
        return data
    return cls.from_dict(data)


# -- probe entries: a backend and its options on one line ----------------------------------------------

@dataclass
class Entry:
    """One probe entry, e.g. 'fp8:scaling=delayed', 'te-fp8:current,modules=linear' (a bare first value is
    te-fp8's recipe) or 'fp8:skip=' (its own layer skip list, '+'-separated; empty: convert every layer,
    the head too, as nanochat's fp8 does)."""
    text: str
    name: str
    options: Options | None
    skip: list[str] | None = None
    """The entry's own layer skip list, replacing the run's; None: the run's layer filter."""

    def recorded(self) -> dict[str, Any]:
        """What probe.json records as the entry's options: those that differ from the defaults, and
        `skip` when the entry set its own (auto leaves such entries out)."""
        out = self.options.changed() if self.options is not None else {}
        if self.skip is not None:
            out["skip"] = "+".join(self.skip)
        return out


def parse_entry(text: str) -> Entry:
    """An Entry from its text; a bad one raises OptionError naming the entry and the key."""
    name, _, rest = text.partition(":")
    probed = [n for n in BACKEND_NAMES if n != "auto"]
    if name not in probed:
        raise OptionError(f"probe entry '{text}': unknown backend '{name}'; choose one of {', '.join(probed)}")
    pairs, skip = {}, None
    for i, part in enumerate(rest.split(",") if rest else []):
        key, eq, value = part.partition("=")
        if key == "skip" and eq:
            skip = [s for s in value.split("+") if s]
        elif eq:
            pairs[key] = value
        elif i == 0 and name == "te-fp8":
            pairs["recipe"] = key
        else:
            raise OptionError(f"probe entry '{text}': '{part}' is not key=value")
    cls = BACKEND_OPTIONS[name]
    if cls is None and pairs:
        raise OptionError(f"probe entry '{text}': backend '{name}' takes no options (only skip=)")
    try:
        options = cls.parse(pairs) if cls is not None else None
    except OptionError as e:
        raise OptionError(f"probe entry '{text}': {e}") from None
    return Entry(text, name, options, skip)
