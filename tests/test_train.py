"""The training loop in process, on a tiny project built by the real stages (prepare, tokenizer, tokenize)
in a temporary folder: its timing metrics measure what they claim."""
from __future__ import annotations

import time

import pytest
import torch

from pipeline.config import params_from_dict
from pipeline.data import TokenStream
from pipeline.prepare import prepare
from pipeline.tokenize import tokenize_all
from pipeline.tokenizer import train_tokenizer
from model.tokenizer import SparkTokenizer
from sparkchat import paths

pytestmark = pytest.mark.timeout(300)

TINY = {
    "model": {"depth": 2, "aspect_ratio": 32, "head_dim": 16, "kv_head_ratio": 2, "seq_len": 64},
    "data": {"synthetic_train": 300, "synthetic_eval": 4},
    "tokenizer": {"vocab_size": 320, "train_chars": 100_000},
    "runtime": {"threads": 1},
    # 8 steps of 2 micro-steps, each logged (the loop reads its clocks on logged steps); evaluation only at
    # the end and no checkpoint, so nothing but micro-steps and the loader falls between the marks
    "pretrain": {"steps": 8, "total_batch_tokens": 1024, "device_batch": 8, "eval_every": 8, "eval_tokens": 512,
                 "checkpoint_every": 100, "log_every": 1},
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project folder with the pretraining token files and a tokenizer, made by the stages' own code."""
    root = tmp_path_factory.mktemp("train")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)  # the stages read and write paths relative to the project root
        p = params_from_dict(TINY)
        prepare(p)
        train_tokenizer(p)
        tokenize_all(SparkTokenizer.load(paths.TOKENIZER))
    return root, p


def idle_with_loader_delay(project, monkeypatch, delay_s: float) -> float:
    """Pretrain with every batch `delay_s` late (0: the real loader untouched); the loop's idle share."""
    from pipeline.train import train

    root, p = project
    monkeypatch.chdir(root)
    if delay_s:
        real_next = TokenStream.next

        def slow_next(self):
            time.sleep(delay_s)
            return real_next(self)

        monkeypatch.setattr(TokenStream, "next", slow_next)
    return train("pretrain", p)["idle_frac"]


def test_reports_keep_timings_out_of_what_git_tracks(project, monkeypatch):
    """The headline metrics and the details (DVC outputs git keeps) hold only what the inputs decide; tokens/s,
    MFU and idle time go to the git-ignored timings report, and the returned values hold all three."""
    import json

    from pipeline.train import train

    root, p = project
    monkeypatch.chdir(root)
    values = train("pretrain", p)
    headline, details, timings = (json.loads(f.read_text()) for f in (
        paths.metrics_file("pretrain"), paths.details_file("pretrain"), paths.timings_file("pretrain")))
    assert set(headline) == {"train_loss", "val_bpb_text"}
    assert {"tokens_per_s", "tokens_per_s_sustained", "idle_frac"} <= set(timings)
    assert not set(timings) & (set(headline) | set(details))
    assert {**headline, **details, **timings} == values
    assert details["steps"] == 8 and details["tokens"] == 8 * 1024
    # the plots: the loss every logged step, val bpb at each evaluation only (no blank cells a chart draws as
    # zero), and tokens/s beside the timings, out of what git keeps
    rows = lambda f: [r.split("\t") for r in f.read_text().splitlines()]  # noqa: E731
    loss, val, speed = rows(paths.plot_file("pretrain")), rows(paths.val_file("pretrain")), \
        rows(paths.throughput_file("pretrain"))
    assert loss[0] == ["step", "loss", "lr"] and [r[0] for r in loss[1:]] == [str(s) for s in range(1, 9)]
    assert val[0] == ["step", "val_bpb"] and len(val) == 2 and val[1][0] == "8"
    assert round(float(val[1][1]), 4) == headline["val_bpb_text"]
    assert speed[0] == ["step", "tokens_per_s"] and [r[0] for r in speed[1:]] == [str(s) for s in range(1, 9)]
    assert all(float(r[1]) > 0 for r in speed[1:]) and paths.throughput_file("pretrain").parent == paths.TIMINGS


def test_waiting_for_a_batch_counts_as_idle(project, monkeypatch):
    """With every batch 0.4 s late (several times a tiny micro-step's compute, even on a busy machine) the
    device waits most of the time, and the metric says so; with the real loader it is busy most of the
    time. (With its clock started before the loader was asked, the wait counted as busy and both read low.)"""
    real = idle_with_loader_delay(project, monkeypatch, 0.0)
    slow = idle_with_loader_delay(project, monkeypatch, 0.4)
    assert slow > 0.5, f"a loader 0.4 s late per batch left the device idle only {slow:.0%} of the time"
    assert real < 0.25, f"the real loader left the device idle {real:.0%} of the time"


def on_a_card(free_bytes: float):
    """The training loop's memory-fit hook as it runs on a GPU with `free_bytes` free (model/memory_fit.py
    `decide` with that figure: the one part a CPU cannot measure is the card)."""
    from model.memory_fit import Shape, decide

    def fit(requested, model, device, *, world, sharded, mode, setting, log):
        batch, line = decide(requested, Shape.of(model, world, sharded), free_bytes, mode, setting, "a small card")
        log(line)
        return batch
    return fit


def test_the_device_batch_follows_the_cards_memory(project, monkeypatch):
    """A card that holds half the device batch: the stage trains at half, with twice the micro-steps (the
    same tokens a step); under `runtime.memory_fit: check` it stops before its first step, naming the
    setting and the value that fits."""
    import dataclasses

    import pipeline.train as T
    from model.gpt import GPT, GPTConfig
    from model.memory_fit import HEADROOM, MemoryFitError, Shape, peak_bytes

    root, p = project
    monkeypatch.chdir(root)
    m = p.model
    with torch.device("meta"):
        shape = Shape.of(GPT(GPTConfig(**m.gpt_config(SparkTokenizer.load(paths.TOKENIZER).vocab_size))))
    free = (peak_bytes(shape, 4) + peak_bytes(shape, 8)) / 2 / HEADROOM  # 4 of the 8 sequences fit
    monkeypatch.setattr(T, "fit_device_batch", on_a_card(free))
    sizes = []
    real_init = TokenStream.__init__

    def recording_init(self, tokens, batch, *a, **kw):
        sizes.append(batch)
        real_init(self, tokens, batch, *a, **kw)

    monkeypatch.setattr(TokenStream, "__init__", recording_init)
    out = T.train("pretrain", p)
    assert sizes[0] == 4  # the train stream: half the device batch
    assert out["tokens"] == p.pretrain.steps * p.pretrain.total_batch_tokens  # the same total batch
    sizes.clear()
    strict = dataclasses.replace(p, runtime=dataclasses.replace(p.runtime, memory_fit="check"))
    with pytest.raises(MemoryFitError, match=r"pretrain\.device_batch=8 would not fit: .* set pretrain\.device_batch to 4"):
        T.train("pretrain", strict)
    assert sizes == []  # before any batch was made
