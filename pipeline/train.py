"""The one training loop behind pretrain, midtrain and SFT.

`train(stage, params)` runs its parts in order:
  1. `start`: picks the device and the precision backend, and checks the backend can run here (before any
     data is read or anything written: a refusal costs nothing), and joins the process group;
  2. `build`: the model (pretrain: from the depth dial; later stages: from the previous stage's model
     directory), with the backend applied (the one place low precision enters), spread over the ranks
     (model/parallel.py: DDP, or FSDP2 with `runtime.parallel: fsdp`), the batches and Muon+AdamW;
  3. `resume`: from the stage's checkpoint if one matches this configuration (written on any number of
     ranks: the data order and a step's batches do not depend on it);
  4. `loop`: gradient accumulation to `total_batch_tokens` (`optimizer_step`), a warmup/constant/warmdown
     schedule, a progress bar (tokens/s, ETA), periodic val bits-per-byte and atomic checkpoints (`save`);
  5. `finish`: the model directory (full-precision safetensors) and the metrics; the TSV plot grows as
     the loop logs.
What the rl stage shares with these (start, setup, the resume branch, the checkpoint, finishing, the
command line) is in pipeline/stage.py.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from model.gpt import GPT, GPTConfig
from model.model_dir import CHECKSUMS, load_model_dir
from model.optim import CombinedOptimizer, build_optimizer
from model.parallel import ddp, fsdp
from model.peak_flops import peak_flops
from model.precision import PrecisionBackend
from model.precision.base import compile_model
from model.loss_eval import evaluate_bpb, token_bytes
from model.memory_fit import MemoryFitError, fit_device_batch
from model.tokenizer import SparkTokenizer
from sparkchat import paths

from .checkpoint import fingerprint
from .config import Params, TrainParams, steps_for_tokens
from .data import ChatBatches, TokenStream, open_tokens
from .metrics import VAL_BPB, TSVLog
from .runtime import log
from .stage import finish_stage, load_state, save_state, setup_stage, stage_main, start

M = paths.MODEL_DIRS
STAGES = {
    # stage: (initial model dir or None, train tokens, val tokens, output model dir)
    "pretrain": (None, paths.PRETRAIN_TRAIN_TOKENS, paths.PRETRAIN_VAL_TOKENS, M["pretrain"]),
    "midtrain": (M["pretrain"], paths.MID_TRAIN_TOKENS, paths.CHAT_VAL_TOKENS, M["midtrain"]),
    "sft": (M["midtrain"], paths.SFT_TRAIN_TOKENS, paths.CHAT_VAL_TOKENS, M["sft"]),
}


class IdleClock:
    """How long the device waited for the host while training: a mark where the host starts handing the
    device a micro-step's work, once its batch is in hand (waiting for the loader is idle time), and one
    where that work ends. On a GPU the marks are CUDA events: the stream reaches a start event only once the
    host has queued it, so end -> next start is time the GPU had nothing queued (a slow loader, the host's
    own bookkeeping). On a CPU the work is done before each call returns, so the host's clock at each mark
    measures the same. Read only on steps the loop synchronises anyway."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.idle_s = self.busy_s = 0.0

    def _mark(self, kind: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        else:
            ev = _HostClock()
        self.marks.append((kind, ev))

    def start(self) -> None:
        self._mark("start")

    def end(self) -> None:
        self._mark("end")

    def skip(self) -> None:
        """Forget the marks: the gap up to the next start is other work (evaluation, a checkpoint)."""
        self.marks = []

    def read(self, count: bool) -> None:
        """Add the gaps since the last read to the totals when `count`; keep the last end mark, from
        which the next gap is measured."""
        if not self.marks:
            return
        self.marks[-1][1].synchronize()
        if count:
            for (k0, e0), (k1, e1) in zip(self.marks, self.marks[1:]):
                dt = e0.elapsed_time(e1) / 1e3
                if (k0, k1) == ("end", "start"):
                    self.idle_s += dt
                elif (k0, k1) == ("start", "end"):
                    self.busy_s += dt
        self.marks = self.marks[-1:] if self.marks[-1][0] == "end" else []

    def fraction(self) -> float | None:
        total = self.idle_s + self.busy_s
        return round(self.idle_s / total, 4) if total else None


class _HostClock:
    """A CPU's stand-in for a CUDA event: the host's clock when it was made."""

    def __init__(self):
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, later: "_HostClock") -> float:
        return (later.t - self.t) * 1e3  # milliseconds, as CUDA events give


def lr_multiplier(step: int, total: int, t: TrainParams) -> float:
    warmup, warmdown = round(t.warmup_frac * total), round(t.warmdown_frac * total)
    if step < warmup:
        return (step + 1) / warmup
    if step >= total - warmdown:
        progress = (total - step) / max(1, warmdown)
        return t.final_lr_frac + (1 - t.final_lr_frac) * progress
    return 1.0


def build_model(stage: str, p: Params, tok: SparkTokenizer, device) -> GPT:
    init_dir = STAGES[stage][0]
    if init_dir is None:
        with torch.device(device):
            model = GPT(GPTConfig(**p.model.gpt_config(tok.vocab_size)))
        model.init_weights(seed=getattr(p, stage).seed)
        return model
    model, _, _ = load_model_dir(init_dir, device=device)
    model.train()
    return model


def make_batches(stage: str, split: Path, tok, p: Params, t: TrainParams, seq_len, pad_fixed, rank, world, device=None):
    """Batches of one token split (memory-mapped: nothing is tokenized or loaded here)."""
    tokens = open_tokens(split, tok)
    if stage in ("pretrain", "midtrain"):
        # a small validation split may hold fewer rows than a training batch: use what there is
        rows = min(t.device_batch, max(1, (len(tokens.ids) - 1) // seq_len))
        return TokenStream(tokens.ids, rows if "val" in split.name else t.device_batch, seq_len, rank, world, device)
    return ChatBatches(tokens, tok.special["<|assistant_end|>"], t.device_batch, seq_len, pad_fixed, seed=t.seed,
                       rank=rank, world=world)


def total_steps(stage: str, t: TrainParams, model: GPT, batches, grad_accum: int) -> int:
    if t.steps:
        steps = t.steps
    elif stage == "pretrain":
        matmul_params = model.num_params() - model.wte.weight.numel()
        steps = steps_for_tokens(t.param_data_ratio * matmul_params, t.total_batch_tokens)
    else:
        return max(1, math.ceil(t.epochs * batches.batches_per_epoch / (grad_accum * batches.world)))
    passes = steps * grad_accum * batches.world / batches.batches_per_epoch
    if stage == "pretrain" and passes > 1:  # prepare's token budget guessed the characters per token low
        log(f"pretrain: {steps} steps read {passes:.2f}x the tokens in the token files, so the text repeats "
            f"(raise data.pretrain_tokens)")
    return steps


@dataclass
class Run:
    """One training stage's parts, made by `build`: what `loop` trains and `finish` saves."""
    stage: str
    p: Params
    t: TrainParams
    backend: PrecisionBackend
    device: torch.device
    rank: int
    world: int
    tok: SparkTokenizer
    model: torch.nn.Module  # what runs a step: the model, or under FSDP its sharded form
    optimizer: CombinedOptimizer
    train_batches: TokenStream | ChatBatches
    val_batches: TokenStream | ChatBatches
    grad_accum: int
    steps: int
    use_compile: bool
    fp: str = ""  # the checkpoints' fingerprint (resume)

    @property
    def sharded(self) -> bool:
        return self.p.runtime.parallel == "fsdp"

    @property
    def seq_len(self) -> int:
        return self.model.config.seq_len

    @property
    def tokens_per_micro(self) -> int:
        return self.t.device_batch * self.seq_len * self.world


@dataclass
class Progress:
    """What the loop measured, for `finish`: the last logged loss and throughput, and the run's timings."""
    loss: float = float("nan")
    tokens_per_s: float = 0.0
    mfu: float | None = None
    sustained: int | None = None
    idle_frac: float | None = None


def build(stage: str, p: Params, backend, device, rank: int, world: int) -> Run:
    """The stage set up (`setup_stage`), then the model (converted by the backend; under FSDP compiled and
    sharded), the batches, the step count and the optimizer."""
    t: TrainParams = getattr(p, stage)
    setup_stage(stage, p, t.seed, rank, world)

    _, train_file, val_file, _ = STAGES[stage]
    tok = SparkTokenizer.load(paths.TOKENIZER)
    model = build_model(stage, p, tok, device)
    seq_len = model.config.seq_len
    model = backend.convert(model)
    log(backend.describe(device))
    # the device batch this GPU's memory holds (the same total batch): before any batch is made
    fits = fit_device_batch(t.device_batch, model, device, world=world, sharded=p.runtime.parallel == "fsdp",
                            mode=p.runtime.memory_fit, setting=f"{stage}.device_batch", log=log)
    t = replace(t, device_batch=fits) if fits != t.device_batch else t
    use_compile = device.type == "cuda" and backend.supports_compile and p.runtime.compile != "off" \
        or p.runtime.compile == "on"
    train_batches = make_batches(stage, train_file, tok, p, t, seq_len, use_compile, rank, world, device)
    val_batches = make_batches(stage, val_file, tok, p, t, seq_len, use_compile, rank, world, device)
    grad_accum = max(1, t.total_batch_tokens // (t.device_batch * seq_len * world))
    steps = total_steps(stage, t, model, train_batches, grad_accum)
    if p.runtime.parallel == "fsdp":
        # compiled block by block before sharding: FSDP's gathers run between the compiled blocks
        if use_compile:
            compile_model(model, regional=True)
        model = fsdp(model, backend.compute_dtype(device))
    optimizer = build_optimizer(model, t.matrix_lr, t.embedding_lr, t.head_lr, t.weight_decay, use_muon=t.use_muon)
    return Run(stage, p, t, backend, device, rank, world, tok, model, optimizer, train_batches, val_batches,
               grad_accum, steps, use_compile)


def resume(run: Run) -> tuple[int, dict]:
    """Loads the stage's checkpoint when one matches this configuration (written on any number of ranks: a
    step reads the same batches on any number). Returns (the step to start from, the history it carried)."""
    stage, t, p = run.stage, run.t, run.p
    init_dir, train_file, val_file, _ = STAGES[stage]
    # the token indexes and the starting model's checksums.json hold each file's sha256 (the model's
    # verified as it loaded): hashing them stands for hashing the files again (a model directory
    # without checksums loads unverified: then its weights themselves). Not the rank count: a step reads
    # the same batches on any number of ranks, so a checkpoint resumes on another one
    inputs = [paths.token_index(train_file), paths.token_index(val_file), paths.TOKENIZER]
    if init_dir:
        inputs.append(init_dir / CHECKSUMS if (init_dir / CHECKSUMS).is_file() else init_dir / "model.safetensors")
    run.fp = fingerprint({"stage": stage, "train": asdict(t), "model": asdict(p.model) if init_dir is None else None,
                          "precision": asdict(p.precision), "backend": run.backend.name, "parallel": p.runtime.parallel,
                          "batches_per_step": run.grad_accum * run.world}, inputs)
    start_step, history = 0, {}
    state = load_state(stage, run.sharded, run.model, run.optimizer, run.fp)
    if state is not None:
        run.train_batches.load_state(state["data"])
        start_step, history = state["step"], state["extra"]
    log(f"{stage}: {run.model.num_params():,} params, {run.steps} steps x {run.grad_accum} micro-steps x "
        f"{t.device_batch}x{run.seq_len} tokens x {run.world} rank(s) = {run.steps * run.grad_accum * run.tokens_per_micro:,} "
        f"tokens on {run.device}{' (compiled)' if run.use_compile else ''}"
        f"{', FSDP' if run.sharded else ', DDP' if run.world > 1 else ''}")
    return start_step, history


def step_model(run: Run) -> torch.nn.Module:
    """What runs a step: compiled on CUDA and wrapped in DDP over several ranks (not under FSDP, which
    `build` compiled and sharded); done after `resume`, which loads into the plain model."""
    model = run.model
    if not run.sharded:
        if run.use_compile:
            model = compile_model(model, run.backend.compile_regions)
        if run.world > 1:
            model = ddp(model, run.device)
    return model


def optimizer_step(run: Run, model, autocast, idle: IdleClock) -> torch.Tensor:
    """One optimizer step: gradient accumulation over `grad_accum` micro-steps, then clipping and the update.
    Returns the micro-steps' summed loss, on the device (read only on logged steps)."""
    loss_sum = torch.zeros((), device=run.device)
    last = run.grad_accum - 1
    for micro in range(run.grad_accum):
        x, y = run.train_batches.next()
        idle.start()  # after the batch is in hand: the wait for it is the device's idle time
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        # DDP all-reduces only in the last micro-step's backward; FSDP reduce-scatters every one
        sync = model.no_sync() if run.world > 1 and not run.sharded and micro < last else contextlib.nullcontext()
        with sync, autocast:
            loss = model(x, y)
        (loss / run.grad_accum).backward()
        loss_sum += loss.detach()
        if micro < last:
            idle.end()
    if run.world > 1:
        run.backend.sync_ranks(run.model)
    if run.t.grad_clip:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.t.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    idle.end()  # the last micro-step's work runs on through the optimizer
    return loss_sum


def loop(run: Run, start_step: int, history: dict) -> Progress:
    """Trains from `start_step` to the end: the learning-rate schedule, a progress bar (tokens/s, ETA), a
    plot row and the clocks' reading on logged steps, periodic validation and checkpoints."""
    stage, t, device, world, steps = run.stage, run.t, run.device, run.world, run.steps
    model = step_model(run)
    autocast = run.backend.autocast(device)
    tbytes = token_bytes(run.tok, device)
    # the same validation batches on any number of ranks (each rank runs its share)
    eval_batches = max(1, t.eval_tokens // (run.val_batches.batch * run.seq_len))
    flops, (peak, peak_about) = run.model.flops_per_token(), peak_flops(device)
    if device.type == "cuda":
        log(f"{stage}: {peak_about}")
    # the loss curve holds only what a resumed run reproduces exactly (no timings), and its rows so far
    # travel in the checkpoint: DVC deletes a stage's outputs before running it, so a resumed stage
    # rewrites the rows before its checkpoint and the plot (and its dvc.lock hash) match an unbroken run
    plot = TSVLog(paths.plot_file(stage), ["step", "loss", "lr"], history.setdefault("log_rows", [])) \
        if run.rank == 0 else None
    val_plot = TSVLog(paths.val_file(stage), ["step", "val_bpb"], history.setdefault("val_rows", [])) \
        if run.rank == 0 else None
    # tokens/s differs on every run: a timings file (git-ignored, undeclared), this run's logged steps
    speed_plot = TSVLog(paths.throughput_file(stage), ["step", "tokens_per_s"]) if run.rank == 0 else None

    def run_eval() -> float:
        model.eval()
        run.val_batches.load_state({"pos": 0, "epoch": 0})
        run.val_batches.limit = eval_batches
        bpb = evaluate_bpb(model, run.val_batches, math.ceil(eval_batches / world), tbytes, device, autocast)
        model.train()
        return bpb

    bar = tqdm(total=steps, initial=start_step, desc=stage, unit="step", disable=run.rank != 0, file=sys.stderr,
               mininterval=1.0, dynamic_ncols=True)
    out = Progress()
    # sustained throughput and idle time count from the end of the first step this run makes (which
    # compiles) to the end, read only on logged steps (which synchronise anyway)
    idle, sustained_from, sustained_to = IdleClock(device), None, 0.0
    model.train()
    for step in range(start_step, steps):
        t0 = time.perf_counter()
        mult = lr_multiplier(step, steps, t)
        run.optimizer.set_lr_multiplier(mult)
        loss_sum = optimizer_step(run, model, autocast, idle)
        done = step + 1
        evaluate_now = done % t.eval_every == 0 or done == steps
        row = done % t.log_every == 0 or evaluate_now  # a plot row: its loss is this step's
        if row or done == start_step + 1:
            if world > 1:  # the step's loss over every rank's batches, as one process would report it
                dist.all_reduce(loss_sum)
                loss_sum /= world
            out.loss = float(loss_sum) / run.grad_accum  # the only host sync per logged step
            dt = time.perf_counter() - t0
            out.tokens_per_s = run.grad_accum * run.tokens_per_micro / dt
            out.mfu = flops * out.tokens_per_s / (peak * world) if peak else None
            idle.read(count=sustained_from is not None)
            if sustained_from is None:
                sustained_from = (done, time.perf_counter())
            sustained_to = time.perf_counter()  # the last step's is before the final evaluation
            if speed_plot is not None:
                speed_plot.log(step=done, tokens_per_s=round(out.tokens_per_s))
            bar.set_postfix(loss=f"{out.loss:.3f}", tok_s=f"{out.tokens_per_s:,.0f}",
                            **({"mfu": f"{out.mfu:.1%}"} if out.mfu else {}))
        val_bpb = run_eval() if evaluate_now else None
        checkpoint_now = done % t.checkpoint_every == 0 and done < steps
        if evaluate_now or checkpoint_now:
            idle.skip()  # the device's wait behind evaluation or a checkpoint is not the loader's
        if val_bpb is not None:
            history["val_bpb"] = val_bpb
        if plot is not None and row:
            plot.log(step=done, loss=out.loss, lr=mult)
        if val_plot is not None and val_bpb is not None:
            val_plot.log(step=done, val_bpb=val_bpb)
        if checkpoint_now:
            save(run, done, history)
        bar.update(1)
    bar.close()
    if sustained_from is not None and sustained_from[0] < steps:
        out.sustained = round((steps - sustained_from[0]) * run.grad_accum * run.tokens_per_micro
                              / (sustained_to - sustained_from[1]))
    out.idle_frac = idle.fraction()
    return out


def save(run: Run, done: int, history: dict) -> None:
    save_state(run.stage, run.sharded, run.rank, run.model, run.optimizer, done, run.train_batches.state(), run.fp,
               history)


def finish(run: Run, progress: Progress, history: dict) -> dict:
    """The model directory, the reports (headline metrics, details, timings: pipeline/metrics.py), and the
    checkpoints removed; returns the three reports' values in one dict."""
    stage, steps, raw_model = run.stage, run.steps, run.model
    backend, out_dir = run.backend, STAGES[stage][3]
    # what the model directory records (meta.json): what the inputs decide, no timings, so the same run gives
    # the same hash
    record = {"steps": steps, "final_loss": round(progress.loss, 4),
              "val_bpb": round(history.get("val_bpb", float("nan")), 4), "params": raw_model.num_params(),
              "backend": backend.name, "backend_label": backend.label, "emulated": backend.emulated,
              "device": str(run.device), "tokens": steps * run.grad_accum * run.tokens_per_micro}
    headline = {"train_loss": record["final_loss"], VAL_BPB[stage]: record["val_bpb"]}
    details = {k: v for k, v in record.items() if k not in ("final_loss", "val_bpb")}
    timings = {"tokens_per_s": round(progress.tokens_per_s)}  # the last logged step's
    if progress.mfu:
        timings["mfu"] = round(progress.mfu, 4)
    if progress.sustained:
        timings["tokens_per_s_sustained"] = progress.sustained  # every step after the first this run made
    if progress.idle_frac is not None:
        timings["idle_frac"] = progress.idle_frac  # of the logged steps after the first
    finish_stage(stage, run.sharded, run.rank, raw_model, out_dir, run.tok, {"stage": stage, **record},
                 (headline, details, timings),
                 f"{stage}: done: loss {record['final_loss']}, {VAL_BPB[stage]} {record['val_bpb']}, model in {out_dir}")
    return {**headline, **details, **timings}


def train(stage: str | None, p: Params) -> dict:
    """Runs `stage`, or with None (a rank `sparkchat join` started) the stage global rank 0 runs: its parts
    in order, start -> build -> resume -> loop -> finish. Returns the metrics."""
    return train_started(*start(stage, p))


def train_started(stage: str, p: Params, backend, device, rank: int, world: int) -> dict:
    """The stage's parts after `start`: build -> resume -> loop -> finish."""
    run = build(stage, p, backend, device, rank, world)
    start_step, history = resume(run)
    return finish(run, loop(run, start_step, history), history)


def main(stage: str) -> None:
    stage_main(stage, lambda p: train(stage, p), errors=(MemoryFitError,))
