"""The probe's numerics canary: does a backend that runs actually train?

A backend can run without an error and still train on nothing: Transformer Engine up to 2.18 quantises
NVFP4 gradients to all-zero FP4 on sm_120/121 (the seed's failed DGX Spark run), and a bad scale turns
a gradient into inf or NaN. The canary catches both before anyone trains on the backend:

1. Gradients, layer by layer, over the probe's first `canary_steps` steps: every trainable tensor's
   gradient is finite at each of those steps, and not all zero at the last of them. (Not at the first:
   the model zero-initialises its output projections, so at step 1 the layers feeding them get zero
   gradients in any healthy run; after one optimizer step they do not.)
2. Loss against bf16's: the losses, averaged over each of up to `WINDOWS` consecutive stretches of the
   probe's steps, stay within `loss_band_pct` percent of bf16's over the same steps.

`gradient_faults` runs inside the probe's training loop (a failure stops that backend there, naming
its layers); `loss_band` runs once bf16's losses are known.
"""
from __future__ import annotations

import torch
import torch.nn as nn

WINDOWS = 5  # stretches of the run the loss band compares (every step, for a probe this short)
SHOWN = 4  # failing layers named in the one-line verdict (all of them are in probe.json)


class NumericsFailure(RuntimeError):
    """A backend's gradients failed the canary: `faults` lists each layer, step and problem."""

    def __init__(self, faults: list[dict]):
        self.faults = faults
        super().__init__(describe_faults(faults))


def layer_name(param_name: str) -> str:
    """The module a parameter belongs to ('blocks.0.mlp.c_fc' for 'blocks.0.mlp.c_fc.weight')."""
    return param_name.removesuffix(".weight")


def gradient_faults(model: nn.Module, step: int, check_zero: bool) -> list[dict]:
    """Every trainable tensor of `model` whose gradient (after backward of step `step`) is missing,
    not finite, or (with check_zero) all zero: [{layer, step, problem}], in the model's order.
    One host sync for the whole model."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    faults = [dict(layer=layer_name(n), step=step, problem="no gradient") for n, p in named if p.grad is None]
    have = [(n, p.grad) for n, p in named if p.grad is not None]
    if not have:
        return faults
    flags = torch.stack([torch.stack([torch.isfinite(g).all(), (g != 0).any()]) for _, g in have]).tolist()
    for (name, _), (finite, nonzero) in zip(have, flags):
        if not finite:
            faults.append(dict(layer=layer_name(name), step=step, problem="gradient not finite (inf or NaN)"))
        elif check_zero and not nonzero:
            faults.append(dict(layer=layer_name(name), step=step, problem="gradient all zero"))
    return faults


def describe_faults(faults: list[dict]) -> str:
    """One line: 'step 2: gradient all zero in blocks.0.mlp.c_fc, blocks.0.mlp.c_proj (and 3 more layers)'."""
    step = faults[0]["step"]
    by_problem: dict[str, list[str]] = {}
    for f in faults:
        if f["step"] == step:
            by_problem.setdefault(f["problem"], []).append(f["layer"])
    parts = []
    for problem, layers in by_problem.items():
        more = f" (and {len(layers) - SHOWN} more layers)" if len(layers) > SHOWN else ""
        parts.append(f"{problem} in {', '.join(layers[:SHOWN])}{more}")
    return f"step {step}: " + "; ".join(parts)


def windows(n: int, count: int = WINDOWS) -> list[tuple[int, int]]:
    """Up to `count` consecutive [start, end) stretches covering n steps, as even as they divide."""
    count = max(1, min(count, n))
    bounds = [round(i * n / count) for i in range(count + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:])]


def loss_band(losses: list[float], reference: list[float], band_pct: float) -> dict:
    """How far `losses` strays from the reference's (bf16's) over the same steps: the mean of each stretch
    (`windows`) against the reference's, in percent. {ok, worst_pct, window, band_pct}; `window` is
    the worst stretch's steps, 1-based and inclusive."""
    n = min(len(losses), len(reference))
    if n == 0:
        return dict(ok=None, worst_pct=None, window=None, band_pct=band_pct)
    worst, where = 0.0, None
    for a, b in windows(n):
        mine, ref = sum(losses[a:b]) / (b - a), sum(reference[a:b]) / (b - a)
        pct = 100.0 * (mine - ref) / ref
        if where is None or not abs(pct) <= abs(worst):  # a NaN is the worst
            worst, where = pct, [a + 1, b]
    return dict(ok=abs(worst) <= band_pct, worst_pct=worst, window=where, band_pct=band_pct)


def verdict(grads: str | None, band: dict | None) -> str:
    """The probe table's canary cell: 'ok', or what failed first."""
    if grads:
        return f"FAIL: {grads}"
    if band is None or band["ok"] is None:
        return "gradients ok; loss not compared (no bf16 run)"
    if not band["ok"]:
        a, b = band["window"]
        return f"FAIL: loss {band['worst_pct']:+.2f}% from bf16's over steps {a}-{b} (band ±{band['band_pct']:g}%)"
    return "ok"
