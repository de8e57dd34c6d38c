"""Every precision backend's options, declared once: one typed dataclass per backend, with defaults,
allowed values (`Literal[...]`) and a docstring per field (torchtitan's float8 converter `Config`), and
the probe's settings.

params.yaml's `precision:` section holds one block per dataclass under the name in its `KEY`
(`precision.fp8`, `precision.te_fp8`, ...); `pipeline/config.py` builds those blocks into these types,
the probe builds them from entries such as `fp8:scaling=delayed`, and each backend receives one. Each
dataclass checks itself on construction (model/settings.py, the one validator of every setting), so a
bad value fails wherever it came from, naming the full key (`precision.fp8.scaling must be one of
dynamic, delayed; got 'lazy'`).

Deliberately free of torch, so the configuration and the command line's `--help` load quickly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Mapping

from model.settings import SettingError, Settings, choices

OptionError = SettingError  # the name the precision package has always raised a bad option under


class Options(Settings):
    """Base of a backend's options (`BACKEND_OPTIONS`): settings with a fixed place under `precision:`."""


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
BackendName = Literal[BACKEND_NAMES]  # the allowed values of a `backend` setting

# How the server holds the model's Linear weights (`sparkchat serve --weights`): bf16 (fp32 on a CPU) or
# fp8, e4m3 with a scale per output channel (fp8_weights.py). Here, so the command line lists them without torch.
ServeWeights = Literal["bf16", "fp8"]
SERVE_WEIGHTS = choices(ServeWeights)


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


# -- the probe's settings ------------------------------------------------------------------------------

@dataclass
class ProbeOptions(Settings):
    """What the precision probe runs (model/precision/probe.py `run_probe`): params.yaml's `probe:` section,
    read by `sparkchat probe` (whose flags override each field)."""
    KEY: ClassVar[str] = "probe"
    MINIMUM: ClassVar[dict[str, float]] = {"steps": 1, "depth": 1, "seq_len": 1, "batch": 1, "vocab": 2,
                                           "canary_steps": 2, "loss_band_pct": 0}
    steps: int = 20
    """Training steps per entry."""
    depth: int = 4
    """Model depth: width 64 x depth, in heads of 128 (nanochat's dial). nvfp4 keeps its last 2 blocks in
    bf16, so a deeper model leaves it layers to convert."""
    seq_len: int = 128
    """Tokens per sequence."""
    batch: int = 4
    """Sequences per step."""
    vocab: int = 2048
    """Vocabulary of the model and of its synthetic data."""
    seed: int = 0
    """Seed of the model and of the data."""
    backends: list[str] = field(default_factory=lambda: ["bf16", "fp8", "fp8:pow2_scales=false", "fp8:scaling=delayed",
                                                         "te-fp8", "te-nvfp4", "fp8-emulated", "nvfp4-emulated"])
    """Entries: a backend name, or name:key=value[,key=value] with the keys of its options (params.yaml's
    precision.<backend>), e.g. fp8:scaling=delayed, te-fp8:current (a recipe) or fp8:skip= (a layer skip
    list of its own; empty: every Linear converts, the head too)."""
    te_recipes: list[TERecipe] = field(default_factory=lambda: list(choices(TERecipe)))
    """Recipes a bare `te-fp8` entry expands to."""
    canary_steps: int = 3
    """Numerics canary (canary.py): steps whose gradients are checked layer by layer, finite at each and not
    all zero at the last; a backend failing it stops there, its layers named."""
    loss_band_pct: float = 2.0
    """Numerics canary: a backend's loss, averaged over each fifth of the steps, stays within this many
    percent of bf16's over the same steps, else the probe marks it failing (and `auto` never picks it)."""

    def check(self, key: str) -> None:
        super().check(key)
        for i, text in enumerate(self.backends):
            try:
                parse_entry(text)
            except SettingError as e:
                raise SettingError(f"{key}.backends[{i}]: {e}") from None
