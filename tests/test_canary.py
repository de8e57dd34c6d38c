"""The probe's numerics canary (model/precision/canary.py): a backend that runs but trains on nothing is
reported as failing, with its layers, before anyone trains on it.

The broken backends here are real backends: their Linears compute a true forward and, in backward,
replace the gradient arriving at each layer with zeros, NaNs or its negation (what a quantiser gone wrong
does: TE <= 2.18's NVFP4 on sm_120/121 rounds every gradient to zero). They are registered beside the
real ones and the real probe trains them."""
from __future__ import annotations

import json
import math

import pytest
import torch

from model.precision import options as options_mod
from model.precision import registry
from model.precision.base import ConvertedLinear, PrecisionBackend, swap_linears
from model.precision.canary import gradient_faults, loss_band, windows
from model.precision.options import AutoOptions, ProbeOptions

TINY = dict(depth=1, seq_len=16, batch=2, vocab=64, seed=0)


class _BadGradient(torch.autograd.Function):
    """y = x W^T; backward hands both GEMMs a gradient that `spoil` has replaced."""

    @staticmethod
    def forward(ctx, x, w, spoil):
        ctx.save_for_backward(x, w)
        ctx.spoil = spoil
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = ctx.spoil(g)
        return g @ w, g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]), None


class _BadLinear(ConvertedLinear):
    def forward(self, x):
        return _BadGradient.apply(x, self.weight, self.spoil)


def _backend(name: str, spoil):
    class Broken(PrecisionBackend):
        def convert(self, model):
            self.converted = swap_linears(model, self.layer_filter, lambda lin: _BadLinear.from_linear(lin, spoil=spoil))
            return model
    Broken.name = name
    return Broken


SPOILS = {
    "zero-grads": lambda g: torch.zeros_like(g),
    "nan-grads": lambda g: torch.full_like(g, float("nan")),
    "ascent-grads": lambda g: -g,  # finite, not zero, and wrong: the loss band catches it
}


@pytest.fixture
def broken_backends(monkeypatch):
    """The broken backends in the registry (and the entry parser's list of names) for one test."""
    for name, spoil in SPOILS.items():
        monkeypatch.setitem(registry.BACKENDS, name, _backend(name, spoil))
        monkeypatch.setitem(options_mod.BACKEND_OPTIONS, name, None)
    monkeypatch.setattr(options_mod, "BACKEND_NAMES", tuple(options_mod.BACKEND_OPTIONS))


def test_zero_and_nan_gradients_are_caught_and_named(broken_backends, tmp_path):
    from model.precision.probe import run_probe
    settings = ProbeOptions(steps=4, backends=["bf16", "zero-grads", "nan-grads", "fp8-emulated"], **TINY)
    out = run_probe(settings, device="cpu", out_dir=str(tmp_path), log=lambda *_: None)
    rows = {r["label"]: r for r in out["results"]}
    # the healthy ones train and pass
    assert rows["bf16"]["canary"] == "ok" and rows["fp8-emulated"]["canary"] == "ok"
    assert rows["fp8-emulated"]["ran"]
    # zeroed gradients: caught at the last canary step (step 1's zeros are the zero-init's, not a fault),
    # every converted layer named, and the head (not converted) not
    zero = rows["zero-grads"]
    assert not zero["ran"] and zero["canary"].startswith("FAIL: step 3: gradient all zero in")
    named = {f["layer"] for f in zero["canary_faults"]}
    assert {"blocks.0.attn.c_qkv", "blocks.0.mlp.c_fc", "blocks.0.mlp.c_proj"} <= named
    assert "lm_head" not in named and "losses" not in zero  # stopped before it trained on
    # NaN gradients: caught at the first step, before the optimizer spread them into the weights
    nan = rows["nan-grads"]
    assert not nan["ran"] and nan["canary"].startswith("FAIL: step 1: gradient not finite (inf or NaN) in")
    assert "blocks.0.mlp.c_fc" in nan["canary"]
    # the table says so, naming the layer
    md = (tmp_path / "probe.md").read_text()
    assert "| zero-grads | yes, but failed: numerics canary: step 3: gradient all zero in" in md
    assert "| nan-grads | yes, but failed: numerics canary: step 1: gradient not finite" in md
    # and merging probes keeps the verdicts
    from model.precision.probe import merge_probes
    merged = {r["label"]: r for r in merge_probes([out])["results"]}
    assert merged["zero-grads"]["canary"] == zero["canary"] and merged["bf16"]["canary"] == "ok"


def test_loss_out_of_band_fails_and_auto_never_picks_it(broken_backends, tmp_path):
    from model.precision.probe import run_probe
    settings = ProbeOptions(steps=12, backends=["bf16", "ascent-grads"], loss_band_pct=1.0, **TINY)
    out = run_probe(settings, device="cpu", out_dir=str(tmp_path), log=lambda *_: None)
    rows = {r["label"]: r for r in out["results"]}
    bad = rows["ascent-grads"]
    assert bad["ran"] and bad["canary_grads"] is None  # its gradients look fine
    assert not bad["canary_loss"]["ok"] and bad["canary_loss"]["worst_pct"] > 1.0
    assert bad["canary"].startswith("FAIL: loss +") and "(band ±1%)" in bad["canary"]
    assert "FAIL: loss +" in (tmp_path / "probe.md").read_text()
    # auto reads the probe: the failing backend is left out even when it is the fastest one listed
    data = json.loads((tmp_path / "probe.json").read_text())
    for r in data["results"]:
        r["tokens_per_s"] = 1e9 if r["label"] == "ascent-grads" else 1.0
        r["loss_diff_pct"] = 0.0
    (tmp_path / "probe.json").write_text(json.dumps(data))
    be = registry.get_backend("auto", AutoOptions(probe_file=str(tmp_path / "probe.json"), max_loss_diff_pct=100))
    pick, why = be._from_probe(torch.device("cpu"))
    assert pick[0] == "bf16", why


def test_loss_band_windows():
    assert windows(3) == [(0, 1), (1, 2), (2, 3)]
    assert windows(10) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    ref = [5.0] * 10
    assert loss_band(ref, ref, 1.0) == dict(ok=True, worst_pct=0.0, window=[1, 2], band_pct=1.0)
    off = ref[:6] + [5.2] * 4  # +4% over the last two fifths
    b = loss_band(off, ref, 2.0)
    assert not b["ok"] and b["worst_pct"] == pytest.approx(4.0) and b["window"] == [7, 8]
    assert loss_band(off, ref, 5.0)["ok"]
    nan = loss_band(ref[:9] + [math.nan], ref, 5.0)
    assert nan["ok"] is False and nan["window"] == [9, 10]


def test_gradient_faults_layer_by_layer():
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2, bias=False))
    lin(torch.randn(3, 4)).sum().backward()
    assert gradient_faults(lin, 2, check_zero=True) == []
    lin[1].weight.grad.zero_()
    lin[0].bias.grad[0] = float("inf")
    assert gradient_faults(lin, 2, check_zero=True) == [
        dict(layer="0.bias", step=2, problem="gradient not finite (inf or NaN)"),
        dict(layer="1", step=2, problem="gradient all zero")]
    assert gradient_faults(lin, 1, check_zero=False) == [
        dict(layer="0.bias", step=1, problem="gradient not finite (inf or NaN)")]
    lin[1].weight.grad = None
    assert dict(layer="1", step=1, problem="no gradient") in gradient_faults(lin, 1, check_zero=False)
