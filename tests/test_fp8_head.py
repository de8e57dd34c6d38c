"""The output head in FP8: an option of the fp8 backend through its layer filter (params
`precision.layer_filter.skip: []`, or the probe entry `fp8:skip=`), as nanochat's fp8 converts it. On a
CPU the fp8 backend runs the same casts and scales as on a GPU (each product dequantised into an fp32
matmul), so the head's FP8 numerics are checked here against the fp32 head of the same weights."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from model.gpt import GPT
from model.precision import LayerFilter, get_backend
from model.precision.fp8 import Fp8Linear
from model.precision.probe import model_config


def _model():
    torch.manual_seed(0)
    model = GPT(model_config(1, 32, 512, head_dim=64))
    model.init_weights(seed=0)
    with torch.no_grad():  # a trained head's scale, not the init's near-zero one
        model.lm_head.weight.normal_(0, 0.05)
    return model


def test_the_head_converts_only_when_the_filter_lets_it():
    default, everything = _model(), _model()
    get_backend("fp8").convert(default)
    get_backend("fp8", None, LayerFilter(16, [])).convert(everything)
    assert not isinstance(default.lm_head, Fp8Linear) and isinstance(everything.lm_head, Fp8Linear)


def test_fp8_head_loss_and_gradients_track_the_fp32_head():
    plain = _model()
    fp8 = copy.deepcopy(plain)
    backend = get_backend("fp8", None, LayerFilter(16, ["blocks"]))  # the head alone in FP8
    backend.convert(fp8)
    assert backend.converted == 1 and isinstance(fp8.lm_head, Fp8Linear)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (4, 32), generator=g)
    y = torch.randint(0, 512, (4, 32), generator=g)
    losses, grads = [], []
    for m in (plain, fp8):
        loss = m(x, y)
        loss.backward()
        losses.append(loss.item())
        grads.append((m.lm_head.weight.grad.clone(), m.blocks[0].mlp.c_proj.weight.grad.clone()))
    # e4m3 keeps 3 mantissa bits: each logit is off by a few percent at most, the loss by far less
    assert abs(losses[1] - losses[0]) / losses[0] < 0.002, losses
    for a, b in zip(*grads):  # the head's own gradient (e5m2 gradients) and one the head's dgrad feeds
        assert F.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.995
        assert (b - a).norm() / a.norm() < 0.1
    # and it is FP8: not the fp32 head's numbers exactly
    assert losses[1] != losses[0]
