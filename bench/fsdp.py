"""The cost of sharding on one GPU: FSDP2 against DDP and against no wrapper, same shape, same backend.

For each backend and each mode the same seeded model trains on the same synthetic Markov tokens
(model/precision/probe.py) with the training stage's step: one micro-step of `batch x seq_len` under
the backend's autocast, gradient clipping at 1.0, Muon + AdamW. The modes wrap the model as the stage
does (model/parallel.py), on a process group of this one GPU:
  - none: the model itself;
  - ddp:  DistributedDataParallel (one rank: its hooks and a one-rank all-reduce, no sharding);
  - fsdp: FSDP2 `fully_shard` per block and on the root, bf16 compute from fp32 shards (what
          `runtime.parallel: fsdp` runs); Muon gathers whole matrices (model/optim.py).
Compilation (`--compile`): `regional` compiles every block and the head on their own in every mode
(FSDP needs that, so the ratio is the cost of sharding alone; and one compiled block serves all of
them, which keeps the compile short); `stage` compiles as the training stage does (none and ddp: the
backend's choice, the whole model for bf16 and fp8; fsdp: regional), so the ratio includes that too.

Speed: every mode is timed over the same steps, the `--timing-steps` after `--warmup` (compile
included there), cut into `--rounds` rounds of consecutive steps; a round's whole-step tokens/s is
its tokens over its steps' time (CUDA events). Reported per run: the median and range over the rounds,
the ratio of medians to `none` with the same backend, peak memory, compile seconds, and the loss after
the run (mean of the last 10 steps) with its difference from `none`'s (`--loss-tol-pct`, default 0.5:
fsdp within it passes). Modes in `--timing-only` stop after the timed steps (ddp by default: one rank
of DDP computes what `none` computes, so only its speed is in question). Results are written after
every run, so a run cut short keeps the finished ones.

    python -m bench.fsdp --depth 20 --batch 16 --steps 200 --backends bf16 fp8 --out DIR
"""
from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from model.gpt import GPT
from model.optim import build_optimizer
from model.parallel import ddp, fsdp
from model.precision import get_backend
from model.precision.base import compile_model, describe_device
from model.precision.probe import StepClock, markov_tokens, model_config
from pipeline.runtime import setup_distributed

from .stats import fmt, save_json, spread

MODES = ("none", "ddp", "fsdp")


def timing(step_s: list[float], warmup: int, timing_steps: int, rounds: int, tokens_per_step: int) -> dict:
    """Whole-step tokens/s over steps [warmup, warmup + timing_steps), the same steps in every mode, cut
    into `rounds` runs of consecutive steps (the first ones a step longer when they do not divide)."""
    timed = step_s[warmup:warmup + timing_steps]
    if len(timed) < timing_steps:
        raise ValueError(f"{len(step_s)} steps ran; timing needs {warmup + timing_steps} (--warmup + --timing-steps)")
    size, extra = divmod(timing_steps, rounds)
    rates, i = [], 0
    for r in range(rounds):
        n = size + (r < extra)
        rates.append(n * tokens_per_step / sum(timed[i:i + n]))
        i += n
    return {"timed_steps": [warmup, warmup + timing_steps], "tokens_per_s": spread(rates, 1),
            "round_tokens_per_s": [round(x, 1) for x in rates]}


def run_one(mode: str, backend_name: str, cfg, data: torch.Tensor, steps: int, batch: int, compile_how: str,
            device: torch.device, seed: int, log, warmup: int, timing_steps: int, rounds: int) -> dict:
    backend = get_backend(backend_name)
    backend.check(device)
    backend.check_parallel("fsdp" if mode == "fsdp" else "ddp")
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(cfg)
    model.init_weights(seed=seed)
    model = backend.convert(model)
    regional = compile_how == "regional" or mode == "fsdp" or backend.compile_regions
    compiled = compile_how != "off" and backend.supports_compile
    if mode == "fsdp":
        if compiled:
            compile_model(model, regional=True)
        model = run = fsdp(model, backend.compute_dtype(device))
        opt = build_optimizer(model, 0.02, 0.2, 0.004)
    else:
        opt = build_optimizer(model, 0.02, 0.2, 0.004)
        run = compile_model(model, regional) if compiled else model
        if mode == "ddp":
            run = ddp(run, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    autocast = backend.autocast(device)
    losses, times, micro_times, pending = [], [], [], []
    t_start = time.perf_counter()
    n_rows = data.shape[0]
    for step in range(steps):
        i = (step * batch) % n_rows
        x, y = data[i:i + batch, :-1].contiguous(), data[i:i + batch, 1:].contiguous()
        clock = StepClock(device)
        with autocast:
            loss = run(x, y)
        loss.backward()
        clock.mark()  # forward + backward (FSDP: the gathers and reduce-scatters too)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()  # (FSDP: Muon's gathers of whole matrices)
        opt.zero_grad(set_to_none=True)
        clock.stop()
        pending.append((clock, loss.detach()))
        if step == 0 or len(pending) >= 10 or step == steps - 1:
            for c, lv in pending:
                micro_s, step_s = c.read()
                times.append(step_s)
                micro_times.append(micro_s)
                losses.append(float(lv))
            pending.clear()
            if step == 0:
                log(f"    step 1 loss {losses[0]:.4f} ({time.perf_counter() - t_start:.0f} s with compile)")
    tokens = batch * cfg.seq_len
    speed = timing(times, warmup, timing_steps, rounds, tokens)
    micro = spread(micro_times[warmup:warmup + timing_steps])
    tail = losses[-min(10, len(losses)):]
    res = dict(mode=mode, backend=backend.label, steps=steps,
               compile=("regional" if regional else "whole") if compiled else "off", **speed,
               micro_ms=micro["median"] * 1e3, step_s_all=times,
               peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else None,
               # the warm-up steps' time beyond a timed step's
               compile_s=sum(times[:warmup]) - warmup * tokens / speed["tokens_per_s"]["median"],
               final_loss=sum(tail) / len(tail), first_loss=losses[0], losses=losses[::10] + [losses[-1]])
    tps = res["tokens_per_s"]
    log(f"    {steps} steps: {tps['median']:,.0f} tok/s ({tps['min']:,.0f}-{tps['max']:,.0f} over {rounds} rounds of "
        f"steps {warmup}-{warmup + timing_steps - 1}; forward + backward {res['micro_ms']:.0f} ms), "
        f"loss {res['final_loss']:.4f}, peak {res['peak_mem_gib'] or 0:.1f} GiB")
    del run, model, opt
    return res


def compare(results: list[dict], tol_pct: float) -> None:
    """Each run against `none` with the same backend: speed ratio; loss difference where both ran as long."""
    for r in results:
        base = next((b for b in results if b["mode"] == "none" and b["backend"] == r["backend"] and "error" not in b), None)
        if base is None or "error" in r:
            continue
        r["speed_vs_none"] = r["tokens_per_s"]["median"] / base["tokens_per_s"]["median"]
        if r["steps"] == base["steps"]:
            r["loss_diff_pct"] = 100 * (r["final_loss"] - base["final_loss"]) / base["final_loss"]
            r["loss_within_tol"] = abs(r["loss_diff_pct"]) <= tol_pct


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.fsdp", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--depth", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=16, help="rows per step (one micro-step)")
    ap.add_argument("--steps", type=int, default=200, help="steps of a run compared for loss")
    ap.add_argument("--warmup", type=int, default=5, help="steps before the timed ones (compile included)")
    ap.add_argument("--timing-steps", type=int, default=40, help="steps timed, the same in every mode")
    ap.add_argument("--rounds", type=int, default=4, help="rounds the timed steps are cut into (median and range)")
    ap.add_argument("--timing-only", nargs="*", default=["ddp"], choices=MODES, help="modes run for speed only")
    ap.add_argument("--backends", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--modes", nargs="+", default=["none", "fsdp", "ddp"], choices=MODES,
                    help="run in this order, each over every backend (the comparisons that matter first)")
    ap.add_argument("--device", default="cuda", help="cpu: a quick check of this script on a small --depth")
    ap.add_argument("--compile", choices=("regional", "stage", "off"), default="regional")
    ap.add_argument("--loss-tol-pct", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="fsdp-bench")
    a = ap.parse_args(argv)
    if not 1 <= a.rounds <= a.timing_steps or a.warmup < 1 or a.steps < a.warmup + a.timing_steps:
        ap.error(f"need 1 <= --rounds ({a.rounds}) <= --timing-steps ({a.timing_steps}), --warmup ({a.warmup}) >= 1 "
                 f"and --steps ({a.steps}) >= --warmup + --timing-steps")
    device = torch.device(a.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench.fsdp measures a GPU: torch sees no CUDA device (--device cpu checks the script)")
        device = torch.device("cuda", 0)
    setup_distributed(device, timeout_s=600, always=True)  # one rank: DDP and FSDP need a process group
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, flush=True)  # noqa: E731
    cfg = model_config(a.depth, a.seq_len, a.vocab)
    data = markov_tokens(a.batch * min(a.steps, 64), a.seq_len + 1, a.vocab, a.seed, device)
    head = dict(device=describe_device(device), torch=torch.__version__, depth=a.depth, width=cfg.n_embd,
                seq_len=a.seq_len, vocab=a.vocab, batch=a.batch, tokens_per_step=a.batch * a.seq_len,
                compile=a.compile, steps=a.steps, warmup=a.warmup, timing_steps=a.timing_steps, rounds=a.rounds,
                loss_tol_pct=a.loss_tol_pct)
    log(f"bench.fsdp on {head['device']}, torch {torch.__version__}: depth {a.depth} (width {cfg.n_embd}), "
        f"{a.batch} x {a.seq_len} tokens a step, compile {a.compile}")
    results = []
    for mode in a.modes:
        for name in a.backends:
            steps = a.warmup + a.timing_steps if mode in a.timing_only else a.steps
            log(f"- {name} / {mode}, {steps} steps")
            try:
                results.append(run_one(mode, name, cfg, data, steps, a.batch, a.compile, device, a.seed, log,
                                       a.warmup, a.timing_steps, a.rounds))
            except Exception as e:  # record it, measure the others
                results.append(dict(mode=mode, backend=name, steps=steps, error=f"{type(e).__name__}: {str(e)[:800]}"))
                log(f"    FAILED: {results[-1]['error']}")
            finally:
                gc.collect()
                torch._dynamo.reset()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            compare(results, a.loss_tol_pct)
            save_json(dict(head, results=results), out / "fsdp.json", indent=1)
    log(f"\n| backend | mode | steps | tok/s (steps {a.warmup}-{a.warmup + a.timing_steps - 1}, median (range) of {a.rounds} rounds) "
        "| vs none | fwd+bwd ms | loss | vs none | peak GiB | compile s |")
    log("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            log(f"| {r['backend']} | {r['mode']} | {r['steps']} | failed: {r['error'][:120]} | | | | | | |")
            continue
        vs = f"{r['speed_vs_none']:.3f}x" if "speed_vs_none" in r else ""
        dl = f"{r['loss_diff_pct']:+.2f}%" if "loss_diff_pct" in r else ""
        log(f"| {r['backend']} | {r['mode']} | {r['steps']} | {fmt(r['tokens_per_s'], ',.0f')} | {vs} | {r['micro_ms']:.0f} | "
            f"{r['final_loss']:.4f} | {dl} | {r['peak_mem_gib'] or 0:.1f} | {r['compile_s']:.0f} |")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
