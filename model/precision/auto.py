"""auto: the fastest backend that passed the probe on this machine.

Choice, in order:
1. A probe.json (from `sparkchat probe`; `AutoOptions.probe_file`, params `precision.auto`) measured
   on a GPU of the same name and compute capability: the highest tokens/s among entries that ran, are
   not emulated, passed the probe's numerics canary, and whose loss stayed within `max_loss_diff_pct` of
   bf16; its options too. Entries
   probed with their own layer filter (`fp8:skip=...`) are left out: they measured other layers than
   the run's `precision.layer_filter` would convert.
2. Otherwise a static order, first one that is available here: PREFERENCE below, from what the probe
   measured on an H200 at d20 (bench/results/precision.md, "Micro-step time by backend" and "fp8's
   cast kernel"). fp8 with its defaults first (needs only torch and, for its cast kernel, Triton, else
   its casts go inline). Delayed scaling measured as fast, but its scales lag a step, so the default
   dynamic scaling goes first. Then te-fp8 with its defaults (slower than fp8 in the same run; needs
   Transformer Engine), then bf16. NVFP4 is never chosen without a probe (its loss needs checking
   first).
The log says which it chose and why. Everything else delegates to the chosen backend.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .base import PrecisionBackend, describe_device
from .fp8_cast import triton_available
from .options import AutoOptions, Fp8Options, options_for

PREFERENCE = [("fp8", Fp8Options(cast="kernel" if triton_available() else "inline")), ("te-fp8", None),
              ("bf16", None)]


class AutoBackend(PrecisionBackend):
    name = "auto"
    options: AutoOptions

    def __init__(self, options=None, layer_filter=None):
        super().__init__(options, layer_filter)
        self.chosen: PrecisionBackend | None = None
        self.reason = ""

    def _from_probe(self, device):
        if not self.options.probe_file:
            return None, "no probe file given"
        path = Path(self.options.probe_file)
        if not path.is_file():
            return None, f"no probe file at {path}"
        data = json.loads(path.read_text())
        here = describe_device(device)
        if data.get("device") != here:
            return None, f"{path} was measured on {data.get('device')!r}, this is {here!r}"
        ok = [r for r in data.get("results", [])
              if r.get("ran") and not r.get("emulated") and r.get("tokens_per_s") and "skip" not in (r.get("options") or {})
              and not str(r.get("canary", "")).startswith("FAIL") and r.get("loss_diff_pct") is not None
              and abs(r["loss_diff_pct"]) <= self.options.max_loss_diff_pct]
        if not ok:
            return None, f"{path} has no non-emulated backend within {self.options.max_loss_diff_pct}% of bf16 loss"
        best = max(ok, key=lambda r: r["tokens_per_s"])
        return (best["backend"], best.get("options") or {}), \
            f"fastest in {path}: {best['tokens_per_s']:.0f} tok/s ({best.get('speedup', 0):.2f}x bf16), " \
            f"loss {best['loss_diff_pct']:+.2f}% vs bf16"

    def select(self, device) -> PrecisionBackend:
        from . import get_backend
        if self.chosen is not None:
            return self.chosen
        device = torch.device(device)
        pick, why = self._from_probe(device)
        if pick is not None:
            cand = get_backend(pick[0], options_for(*pick), self.layer_filter)
            if cand.unavailable_reason(device) is None:
                self.chosen, self.reason = cand, why
                return cand
            why = f"probe's pick {pick[0]} does not run here"
        if device.type != "cuda":  # low precision brings no speedup off the GPU
            self.chosen, self.reason = get_backend("bf16", None, self.layer_filter), f"{why}; not a CUDA device"
            return self.chosen
        for name, opts in PREFERENCE:
            cand = get_backend(name, opts, self.layer_filter)
            r = cand.unavailable_reason(device)
            if r is None:
                self.chosen, self.reason = cand, f"{why}; static preference {[n for n, _ in PREFERENCE]}: first available"
                return cand
        raise RuntimeError("no backend available")  # bf16 always is

    # -- delegation ---------------------------------------------------------------------------
    def unavailable_reason(self, device):
        return None  # bf16 always runs, so auto always finds something

    def check(self, device):
        self.select(device)

    @property
    def supports_compile(self):
        return self.chosen.supports_compile if self.chosen else True

    @property
    def compile_regions(self):
        return self.chosen.compile_regions if self.chosen else False

    @property
    def supports_fsdp(self):
        return self.chosen.supports_fsdp if self.chosen else True

    @property
    def emulated(self):
        return self.chosen.emulated if self.chosen else False

    @property
    def label(self) -> str:
        return f"auto:{self.chosen.label}" if self.chosen else "auto"

    def compute_dtype(self, device):
        return self.select(device).compute_dtype(device)

    def compute_dtype_reason(self, device):
        return self.select(device).compute_dtype_reason(device)

    def convert(self, model):
        dev = next(model.parameters()).device
        out = self.select(dev).convert(model)
        self.converted = self.chosen.converted
        return out

    def autocast(self, device):
        return self.select(device).autocast(device)

    def sync_ranks(self, model):
        self.chosen.sync_ranks(model)

    def describe(self, device):
        chosen = self.select(device)
        return f"auto -> {chosen.label} ({self.reason}); " + chosen.describe(device)
