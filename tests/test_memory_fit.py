"""The device batch follows the GPU's memory (model/memory_fit.py): the decision from given memory
figures, the error texts, the training loop's hook, and every GPU profile against the cards it names."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from model import memory_fit
from model.gpt import GPT, GPTConfig
from model.memory_fit import GIB, MemoryFitError, Shape, decide, fit_batch, fit_device_batch, halvings, peak_bytes
from model.precision.probe import model_config

ROOT = Path(__file__).resolve().parent.parent
# what torch.cuda.mem_get_info reports free on an idle card, about
H100, H200, GB10 = 79.1 * GIB, 139.8 * GIB, 119.0 * GIB


def shape(depth: int, seq_len: int = 2048, vocab: int = 65536, **kw) -> Shape:
    with torch.device("meta"):
        return Shape.of(GPT(model_config(depth, seq_len, vocab)), **kw)


def test_estimate_against_the_measured_peaks():
    """On the safe side of every bf16 peak measured (bench/results/precision.md, issue 56's H100 run)."""
    d12, d20 = shape(12), shape(20)
    assert 35.7 <= peak_bytes(d12, 32) / GIB < 1.1 * 35.7  # d12 whole step, batch 32
    assert 44.6 <= peak_bytes(d20, 16) / GIB < 1.1 * 44.6  # d20 whole step, batch 16
    assert peak_bytes(d20, 32) / GIB >= 83.3  # d20 micro-step alone, batch 32
    # DDP adds its gradient buckets; FSDP divides the state over the ranks
    assert peak_bytes(shape(20, world=8), 16) > peak_bytes(d20, 16) > peak_bytes(shape(20, world=8, sharded=True), 16)


def test_d20_halves_on_an_h100_and_not_on_an_h200():
    d20 = shape(20)
    assert halvings(32) == [32, 16, 8, 4, 2, 1] and halvings(12) == [12, 6, 3, 1]
    assert fit_batch(32, d20, H100) == 16 and fit_batch(32, d20, H200) == 32
    batch, line = decide(32, d20, H100, "fit", "pretrain.device_batch", "NVIDIA H100 80GB HBM3")
    assert batch == 16
    assert line.startswith("pretrain.device_batch 32 -> 16 to fit the card") and "NVIDIA H100 80GB HBM3" in line
    assert "gradient accumulation keeps the total batch" in line
    assert decide(32, d20, H200, "fit", "pretrain.device_batch", "H200")[0] == 32
    assert decide(32, d20, 1 * GIB, "off", "pretrain.device_batch", "tiny")[0] == 32


def test_check_refuses_naming_the_setting_and_what_fits():
    with pytest.raises(MemoryFitError) as e:
        decide(32, shape(20), H100, "check", "sft.device_batch", "NVIDIA H100 80GB HBM3")
    msg = str(e.value)
    assert msg.startswith("sft.device_batch=32 would not fit: estimated peak 87.")
    assert "GiB free on NVIDIA H100 80GB HBM3" in msg and "set sft.device_batch to 16" in msg
    assert "runtime.memory_fit: fit" in msg
    # not even one sequence: the model itself is the setting to change
    with pytest.raises(MemoryFitError, match=r"even 1 sequence needs an estimated .*smaller model\.depth or "
                                             r"model\.seq_len, or runtime\.parallel=fsdp"):
        decide(32, shape(20), 8 * GIB, "fit", "pretrain.device_batch", "a small card")


def test_hook_measures_the_card(monkeypatch):
    """The training loop's hook: on CUDA it reads the card's free memory and decides; elsewhere it keeps the batch."""
    with torch.device("meta"):
        model = GPT(model_config(20, 2048, 65536))
    monkeypatch.setattr(memory_fit, "available", lambda device: (H100, "NVIDIA H100 80GB HBM3 (79.2 GiB)"))
    lines = []
    assert fit_device_batch(32, model, "cuda", setting="pretrain.device_batch", log=lines.append) == 16
    assert "-> 16" in lines[0]
    with pytest.raises(MemoryFitError, match="set pretrain.device_batch to 16"):
        fit_device_batch(32, model, "cuda", mode="check", setting="pretrain.device_batch", log=lines.append)
    assert fit_device_batch(32, model, "cpu") == 32  # nothing measured off the GPU


# the cards each GPU profile names (its header comment and README's profiles table)
CARDS = {"h200": [H100, H200], "h200-small": [H100, H200], "node8": [H100, H200], "spark": [GB10],
         "spark-pair": [GB10]}


@pytest.mark.parametrize("profile", sorted(CARDS))
def test_every_gpu_profile_fits_the_cards_it_names(profile):
    """Each training stage's device batch, halved as the loop would on each card, fits it, and gradient
    accumulation keeps the stage's total batch."""
    from pipeline.config import params_from_dict
    d = yaml.safe_load((ROOT / "params.yaml").read_text())
    d["profile"] = profile
    p = params_from_dict(d, ROOT / "profiles")
    m = p.model
    cfg = GPTConfig(vocab_size=p.tokenizer.vocab_size, n_layer=m.depth, n_embd=m.n_embd, n_head=m.n_head,
                    n_kv_head=m.n_head, seq_len=m.seq_len)
    with torch.device("meta"):
        model = GPT(cfg)
    world = p.runtime.nproc * p.runtime.nnodes
    s = Shape.of(model, world, p.runtime.parallel == "fsdp")
    for card in CARDS[profile]:
        for stage in ("pretrain", "midtrain", "sft"):
            t = getattr(p, stage)
            batch, _ = decide(t.device_batch, s, card, p.runtime.memory_fit, f"{stage}.device_batch", "card")
            assert peak_bytes(s, batch) <= card
            before = max(1, t.total_batch_tokens // (t.device_batch * m.seq_len * world)) * t.device_batch
            after = max(1, t.total_batch_tokens // (batch * m.seq_len * world)) * batch
            assert after == before, (profile, stage, t.device_batch, batch)
