"""Does a training step fit this GPU's memory, and which device batch does?

A profile names a device batch for a model shape, but cards differ: the d20 profile's 32 sequences of
2048 tokens peak above an 80 GB H100's memory and fit a 141 GB H200 (bench/results/precision.md, "Micro-step
time by backend": 83.3 GiB at batch 32 before any optimizer state). nanochat's answer is to halve
`--device_batch_size` by hand until it fits, gradient accumulation keeping the total batch; here the
training loop does that itself at start (`runtime.memory_fit: fit`), or refuses before the first step
naming the setting to change (`check`); the probe refuses a `--batch` that would not fit, and the GPU
recipes ask bench/fit_batch.py for the batch that does.

The estimate is the peak of one step from the shape:
    params x STATE_BYTES          fp32 weights, their gradients, the optimizer's state (Muon's momentum,
                                  AdamW's two moments); under DDP also its gradient buckets; under FSDP
                                  all of it divided over the ranks
  + batch x seq_len x (ACT_BYTES x layers x width + LOGIT_BYTES x vocab)
                                  the activations a backward keeps, per token: the blocks', and the
                                  output head's logits
ACT_BYTES and LOGIT_BYTES are fitted to two bf16 peaks measured at batch 32 and sequence 2048 on
Hopper (vocabulary 65,536): d12's whole step, 35.7 GiB (bench/results/precision/long_run_d12_bf16_fp8.json),
and d20's micro-step, 83.3 GiB (precision/train_step_d20.json); the fit then overestimates d20's whole step
at batch 16 (44.6 GiB measured on an H100, issue 56) by about 7%, on the safe side. bf16 is the
bound for every backend: fp8 keeps FP8 copies and peaked lower at both shapes. A shape far from
those (another sequence length, a much smaller vocabulary) is an extrapolation, so a run keeps
HEADROOM of the card free.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 2 ** 30
STATE_BYTES = 16  # fp32 weight 4 + fp32 gradient 4 + optimizer state up to 8 (AdamW's two fp32 moments)
DDP_BUCKET_BYTES = 4  # DDP's fp32 gradient buckets beside the gradients
ACT_BYTES = 46.1  # per token, layer and unit of width (fitted, above)
LOGIT_BYTES = 1.8  # per token and vocabulary entry (fitted, above)
HEADROOM = 0.95  # a step may use this much of the memory free at start; the rest is for the allocator's slack


class MemoryFitError(RuntimeError):
    """A run that would not fit this GPU's memory: the message names the setting to change."""


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model and its parallel layout."""
    params: int
    layers: int
    width: int
    seq_len: int
    vocab: int
    world: int = 1
    sharded: bool = False  # FSDP: weights, gradients and optimizer state divided over `world` ranks

    @classmethod
    def of(cls, model, world: int = 1, sharded: bool = False) -> "Shape":
        c = model.config
        return cls(sum(p.numel() for p in model.parameters()), c.n_layer, c.n_embd, c.seq_len, c.vocab_size,
                   world, sharded)


def peak_bytes(shape: Shape, batch: int) -> float:
    """The estimated peak memory of one training step at `batch` sequences a device (bytes)."""
    state = shape.params * STATE_BYTES
    if shape.sharded:
        state /= shape.world
    elif shape.world > 1:
        state += shape.params * DDP_BUCKET_BYTES
    per_token = ACT_BYTES * shape.layers * shape.width + LOGIT_BYTES * shape.vocab
    return state + batch * shape.seq_len * per_token


def halvings(requested: int) -> list[int]:
    """requested, requested // 2, ... down to 1: the device batches tried, largest first."""
    out = [requested]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def fit_batch(requested: int, shape: Shape, available_bytes: float) -> int | None:
    """The largest of `halvings(requested)` whose estimated peak fits HEADROOM of `available_bytes`; None
    when not even one sequence does."""
    return next((b for b in halvings(requested) if peak_bytes(shape, b) <= HEADROOM * available_bytes), None)


def decide(requested: int, shape: Shape, available_bytes: float, mode: str, setting: str, card: str) -> tuple[int, str]:
    """(the device batch to run, a line for the log) for `requested` sequences under `mode` (params
    `runtime.memory_fit`): fit: the largest halving that fits | check: `requested` or MemoryFitError |
    off: `requested`.
    `setting` is the params key of the device batch (the error names it); `card` describes the GPU."""
    if mode == "off":
        return requested, f"{setting} {requested}: memory fit not checked (runtime.memory_fit: off)"
    need = peak_bytes(shape, requested)
    about = (f"estimated peak {need / GIB:.1f} GiB of {available_bytes / GIB:.1f} GiB free on {card} "
             f"(model/memory_fit.py)")
    if need <= HEADROOM * available_bytes:
        return requested, f"{setting} {requested} fits: {about}"
    fits = fit_batch(requested, shape, available_bytes)
    if fits is None:
        raise MemoryFitError(
            f"{setting}={requested} would not fit: {about}, and even 1 sequence needs an estimated "
            f"{peak_bytes(shape, 1) / GIB:.1f} GiB; use a smaller model.depth or model.seq_len, or "
            f"runtime.parallel=fsdp over more GPUs")
    if mode == "check":
        raise MemoryFitError(
            f"{setting}={requested} would not fit: {about}; set {setting} to {fits} (gradient accumulation "
            f"keeps the total batch), or runtime.memory_fit: fit to let the device batch follow the card")
    return fits, (f"{setting} {requested} -> {fits} to fit the card ({about}; {peak_bytes(shape, fits) / GIB:.1f} "
                  f"GiB at {fits}); gradient accumulation keeps the total batch")


def available(device) -> tuple[float, str]:
    """(bytes this process may use on a CUDA device: free plus what its own allocator holds, a description)."""
    import torch
    free, total = torch.cuda.mem_get_info(device)
    mine = torch.cuda.memory_reserved(device)
    return free + mine, f"{torch.cuda.get_device_name(device)} ({total / GIB:.1f} GiB)"


def fit_device_batch(requested: int, model, device, *, world: int = 1, sharded: bool = False, mode: str = "fit",
                     setting: str = "device_batch", log=print) -> int:
    """The training loop's hook, before its first step: the device batch to run on this GPU (decide's
    rules; the log says what and why). Off a CUDA device, where nothing is measured: `requested`."""
    import torch
    device = torch.device(device)
    if device.type != "cuda" or mode == "off":
        return requested
    free, card = available(device)
    batch, line = decide(requested, Shape.of(model, world, sharded), free, mode, setting, card)
    log(line)
    return batch
