"""The precision probe's library: which backends run on this machine, and what each one buys.

For every entry (a backend and its options, options.parse_entry; a bare `te-fp8` is every TE recipe)
it first records "available" or the exact reason it is not, then trains the same model from the same
seed on the same data for N steps under each one that runs: final loss and its difference from bf16,
tokens/s and speedup over bf16, peak memory, MFU; and the numerics canary (canary.py): gradients finite and
not all zero layer by layer over the first steps, losses within a band of bf16's. `run_probe` returns the probe.json dict (and writes
probe.json, which `auto` reads, and probe.md, a Markdown table). The command (`sparkchat probe`, the
DVC stage) is pipeline/probe.py; bench/ uses the helpers here.

Data: a token file (uint16/int32 .bin or .npy of token ids, `tokens`) or, by default, a synthetic
first-order Markov source (each token has 8 successors with Zipf probabilities), which the model can
learn within a few hundred steps, so losses are comparable (uniform random tokens would pin every
backend at ln(vocab)).
Timing: medians over the steps after warm-up (compile), by CUDA events: the forward + backward micro-step
(tokens/s, speedup and MFU; the part a backend changes) and the whole step with the optimizer. The host
reads losses every 10 steps, as a training loop would, so it queues work ahead of the GPU.
MFU: `model.flops_per_token()` (counted from the shape, so the same for every backend) x tokens/s / the
GPU's dense BF16 peak (model/peak_flops.py; none for a GPU the table does not hold, with the reason).
"""
from __future__ import annotations

import gc
import json
import math
import statistics
import time
from pathlib import Path

import torch

from model.device import resolve_device
from model.gpt import GPT, GPTConfig
from model.memory_fit import fit_device_batch
from model.optim import build_optimizer
from model.peak_flops import peak_flops

from .base import compile_model, describe_device
from .canary import NumericsFailure, gradient_faults, loss_band, verdict
from .options import Entry, LayerFilter, ProbeOptions, TERecipe, TEFp8Options, choices, parse_entry
from .registry import get_backend


MAX_DATA_TOKENS = 1 << 27  # the synthetic corpus's cap: 1 GiB as int64 on the probe's device


def model_config(depth: int, seq_len: int, vocab: int, head_dim: int = 128) -> GPTConfig:
    """nanochat's one dial: width 64 x depth, heads of `head_dim`, n_kv_head = n_head (full MHA)."""
    width = 64 * depth
    n_head = max(1, width // head_dim)
    return GPTConfig(vocab_size=vocab, n_layer=depth, n_embd=width, n_head=n_head, n_kv_head=n_head,
                     seq_len=seq_len)


def markov_tokens(n_rows: int, length: int, vocab: int, seed: int, device, fanout: int = 8) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, fanout), generator=g).to(device)
    p = 1.0 / torch.arange(1, fanout + 1, dtype=torch.float32)
    slots = torch.multinomial(p / p.sum(), n_rows * length, replacement=True, generator=g).view(n_rows, length)
    slots = slots.to(device)
    out = torch.empty(n_rows, length, dtype=torch.long, device=device)
    out[:, 0] = torch.randint(0, vocab, (n_rows,), generator=g).to(device)
    for t in range(1, length):
        out[:, t] = succ[out[:, t - 1], slots[:, t]]
    return out


def file_tokens(path: str, n_rows: int, length: int, vocab: int, device) -> torch.Tensor:
    import numpy as np
    p = Path(path)
    arr = np.load(p) if p.suffix == ".npy" else np.memmap(p, dtype=np.uint16, mode="r")
    need = n_rows * length
    if arr.size < need:
        reps = math.ceil(need / arr.size)
        arr = np.tile(np.asarray(arr), reps)
    t = torch.from_numpy(np.asarray(arr[:need]).astype("int64")).view(n_rows, length)
    if int(t.max()) >= vocab:
        raise ValueError(f"{path} holds token ids up to {int(t.max())}, above the probe vocab {vocab}")
    return t.to(device)


def expand_entries(backends: list[str], te_recipes: list[str] | None = None) -> list[Entry]:
    """The entries to probe, parsed into typed options (a bad one raises OptionError naming the entry and
    the key); a bare `te-fp8` becomes one entry per recipe in `te_recipes` (default: every recipe)."""
    out = []
    for text in backends:
        if text == "te-fp8":
            out += [Entry(f"te-fp8:{r}", "te-fp8", TEFp8Options(recipe=r)) for r in te_recipes or choices(TERecipe)]
        else:
            out.append(parse_entry(text))
    return out


def entry_filter(entry: Entry, default: LayerFilter) -> tuple[LayerFilter, str]:
    """An entry's layer filter: its own skip list (`skip=a+b`) replaces the default's for this entry only.
    Returns (filter, label suffix)."""
    if entry.skip is None:
        return default, ""
    return LayerFilter(default.dim_multiple, list(entry.skip)), f"[skip={'+'.join(entry.skip) or 'none'}]"


def build_under(name, options, layer_filter, cfg, seed, device, lrs=(0.02, 0.2, 0.004)):
    """(backend, model, optimizer): the same seeded model for every backend, converted by this one
    (`options`: the backend's typed options, None for its defaults)."""
    backend = get_backend(name, options, layer_filter)
    backend.check(device)
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(cfg)
    model.init_weights(seed=seed)
    model = backend.convert(model)
    return backend, model, build_optimizer(model, *lrs)


def _train(name, options, cfg, data, steps, batch, seed, device, compile_, layer_filter, lrs, log, canary_steps=3):
    backend, model, opt = build_under(name, options, layer_filter, cfg, seed, device, lrs)
    describe = backend.describe(device)
    log("  " + describe)
    compiled = compile_ and device.type == "cuda" and backend.supports_compile
    run = compile_model(model, backend.compile_regions) if compiled else model
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    losses, times, micro_times = [], [], []
    pending = []  # steps whose loss and timings the host has not read yet

    def drain():
        # reading a loss waits for the GPU: done every few steps, not every step, so the host keeps
        # queueing work ahead and the GPU never idles between the timed steps
        for n, clock, loss in pending:
            lv = loss.item()
            micro_s, step_s = clock.read()
            times.append(step_s)
            micro_times.append(micro_s)
            losses.append(lv)
            if n in (1, steps) or n % max(1, steps // 5) == 0:
                log(f"    step {n}/{steps} loss {lv:.4f} {step_s * 1e3:.0f} ms")
            if not math.isfinite(lv):
                raise FloatingPointError(f"loss became {lv} at step {n}")
        pending.clear()

    n_rows = data.shape[0]
    for step in range(steps):
        i = (step * batch) % n_rows
        chunk = data[i:i + batch]
        x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        clock = StepClock(device)
        with backend.autocast(device):
            loss = run(x, y)
        loss.backward()
        clock.mark()  # forward + backward: the part a precision backend changes
        if step < canary_steps:  # the numerics canary (canary.py), inside the warm-up steps the medians skip
            last = min(canary_steps, steps)
            faults = gradient_faults(model, step + 1, check_zero=step + 1 == last and last >= 2)
            if faults:
                raise NumericsFailure(faults)
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.stop()
        pending.append((step + 1, clock, loss.detach()))
        if step < 3 or len(pending) >= 10 or step == steps - 1:
            drain()
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    warm = min(max(3, steps // 10), steps - 1)
    med = statistics.median(times[warm:])
    micro = statistics.median(micro_times[warm:])
    tail = losses[-min(10, len(losses)):]
    res = dict(describe=describe, emulated=bool(backend.emulated),
               converted=backend.converted, compiled=compiled,
               final_loss=sum(tail) / len(tail), last_loss=losses[-1], first_loss=losses[0],
               micro_ms=micro * 1e3, step_ms=med * 1e3, compile_s=sum(times[:warm]) - med * warm,
               tokens_per_s=batch * cfg.seq_len / micro, step_tokens_per_s=batch * cfg.seq_len / med,
               peak_mem_gib=peak, losses=losses,
               # every timed step after warm-up, so a run's speed has a range, not only a median
               micro_ms_each=[round(t * 1e3, 3) for t in micro_times[warm:]],
               step_ms_each=[round(t * 1e3, 3) for t in times[warm:]])
    del run, model, opt
    return res


class StepClock:
    """Seconds from construction to `mark()` and to `stop()`, read later with `read()`: CUDA events on a
    GPU (nothing waits until `read`), the host clock on a CPU, where work is synchronous."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            self.events[0].record()
        else:
            self.t = [time.perf_counter()]

    def mark(self):
        self._record(1)

    def stop(self):
        self._record(2)

    def _record(self, i: int):
        if self.cuda:
            self.events[i].record()
        else:
            self.t.append(time.perf_counter())

    def read(self) -> tuple[float, float]:
        if self.cuda:
            self.events[2].synchronize()
            return self.events[0].elapsed_time(self.events[1]) / 1e3, self.events[0].elapsed_time(self.events[2]) / 1e3
        return self.t[1] - self.t[0], self.t[2] - self.t[0]


def run_probe(settings: ProbeOptions, *, tokens: str | None = None, device: str | torch.device | None = None,
              compile: bool = True, layer_filter: LayerFilter | None = None, lrs: tuple = (0.02, 0.2, 0.004),
              out_dir: str | None = None, log=print) -> dict:
    """Probe every entry of `settings.backends` (the shape, steps and entries: params.yaml's `probe:`
    section, options.ProbeOptions); returns the probe.json dict (and writes probe.json/probe.md to out_dir)."""
    steps, depth, seq_len, batch, vocab, seed = (settings.steps, settings.depth, settings.seq_len, settings.batch,
                                                 settings.vocab, settings.seed)
    dev = resolve_device(device)
    cfg = model_config(depth, seq_len, vocab)
    entries = expand_entries(settings.backends, settings.te_recipes)
    layer_filter = layer_filter or LayerFilter()
    peak, peak_about = peak_flops(dev)
    if dev.type == "cuda":  # a batch this GPU cannot hold stops here, naming the setting, not at an OOM mid-way
        with torch.device("meta"):
            fit_device_batch(batch, GPT(cfg), dev, mode="check", setting="probe.batch (--batch)", log=log)
    log(f"probe on {describe_device(dev)}: depth {depth} (width {cfg.n_embd}, {cfg.n_head} heads), seq {seq_len}, "
        f"batch {batch} ({batch * seq_len} tokens/step), {steps} steps, seed {seed}; {peak_about}")
    # fresh rows for every step (the loss is then a held-out loss, and a long run does not memorise a
    # small pool), up to MAX_DATA_TOKENS; past that the rows repeat
    n_rows = batch * max(1, min(steps, MAX_DATA_TOKENS // (batch * (seq_len + 1))))
    data = file_tokens(tokens, n_rows, seq_len + 1, vocab, dev) if tokens else \
        markov_tokens(n_rows, seq_len + 1, vocab, seed, dev)
    flops = GPT.flops_per_token(type("M", (), {"config": cfg})())
    results = []
    for entry in entries:
        entry_lf, suffix = entry_filter(entry, layer_filter)
        be = get_backend(entry.name, entry.options, entry_lf)
        row = dict(backend=entry.name, options=entry.recorded(), label=be.label + suffix, emulated=bool(be.emulated))
        reason = be.unavailable_reason(dev)
        row["available"] = reason is None
        row["reason"] = reason
        row["ran"] = False
        log(f"- {row['label']}: {'available' if reason is None else 'NOT available: ' + reason}")
        if reason is None:
            try:
                row.update(_train(entry.name, entry.options, cfg, data, steps, batch, seed, dev, compile, entry_lf, lrs,
                                  log, settings.canary_steps))
                row["ran"] = True
                row["mfu"] = flops * row["tokens_per_s"] / peak if peak else None
                row["canary_grads"] = None
            except NumericsFailure as e:  # runs, but trains on nothing: named, layer by layer
                row.update(canary_grads=str(e), canary_faults=e.faults, error=f"numerics canary: {e}")
                log(f"  FAILED the numerics canary: {e}")
            except Exception as e:  # record, keep probing the others
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                log(f"  FAILED: {row['error']}")
            finally:
                gc.collect()
                if dev.type == "cuda":
                    torch._dynamo.reset()
                    torch.cuda.empty_cache()
        results.append(row)
        if out_dir:  # partial results survive a run cut short
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "probe.partial.json").write_text(json.dumps(results, indent=1) + "\n")
    compare_to_bf16(results, settings.loss_band_pct)
    out = dict(device=describe_device(dev), torch=torch.__version__, te=_te_version(),
               config=dict(depth=depth, width=cfg.n_embd, n_head=cfg.n_head, seq_len=seq_len, batch=batch,
                           tokens_per_step=batch * seq_len, steps=steps, seed=seed, vocab=vocab,
                           canary_steps=settings.canary_steps, loss_band_pct=settings.loss_band_pct,
                           data=tokens or "markov-synthetic", flops_per_token=flops,
                           peak_tflops=peak and peak / 1e12, mfu=peak_about,
                           params=cfg.n_layer * 12 * cfg.n_embd ** 2 + 2 * vocab * cfg.n_embd),
               results=results)
    if out_dir:
        write_probe(out, out_dir)
    return out


def compare_to_bf16(results: list[dict], band_pct: float | None) -> None:
    """Loss difference and speedup of every entry that ran, against the bf16 entry, and the numerics
    canary's verdict (canary.py) of every entry that trained: its gradients, its losses in the band."""
    base = next((r for r in results if r["backend"] == "bf16" and r["ran"]), None)
    band_pct = ProbeOptions.loss_band_pct if band_pct is None else band_pct  # a probe.json from before the canary
    for r in results:
        if r["ran"] and base:
            r["loss_diff_pct"] = 100.0 * (r["final_loss"] - base["final_loss"]) / base["final_loss"]
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        if "canary_grads" in r:
            band = loss_band(r["losses"], base["losses"], band_pct) if r["ran"] and base else None
            r["canary_loss"] = band
            r["canary"] = verdict(r["canary_grads"], band)


def write_probe(out: dict, out_dir: str) -> None:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "probe.json").write_text(json.dumps(out, indent=1) + "\n")
    (d / "probe.md").write_text(to_markdown(out))


def merge_probes(outs: list[dict]) -> dict:
    """One probe from several runs of the same configuration on the same device (e.g. bf16 and fp8 in
    one process, the TE recipes in another); a backend probed twice keeps its last result that ran."""
    first = outs[0]
    keys = ("depth", "width", "seq_len", "batch", "steps", "seed", "vocab", "data", "peak_tflops", "canary_steps",
            "loss_band_pct")
    for o in outs[1:]:
        if o["device"] != first["device"]:
            raise ValueError(f"cannot merge probes of different devices: {first['device']!r} and {o['device']!r}")
        diff = [k for k in keys if o["config"].get(k) != first["config"].get(k)]
        if diff:
            raise ValueError(f"cannot merge probes with different {', '.join(diff)}")
    results: dict[str, dict] = {}
    for o in outs:
        for r in o["results"]:
            if r["ran"] or r["label"] not in results:  # a failed or refused row never hides a result
                r = {k: v for k, v in r.items() if k not in ("loss_diff_pct", "speedup", "canary_loss", "canary")}
                results[r["label"]] = r
    merged = dict(first, te=next((o["te"] for o in outs if o.get("te")), None),
                  torch=", ".join(sorted({o["torch"] for o in outs})), results=list(results.values()))
    compare_to_bf16(merged["results"], first["config"].get("loss_band_pct"))
    return merged


def _te_version():
    try:
        import transformer_engine
        return transformer_engine.__version__
    except Exception:
        return None


def _mfu_basis(config: dict) -> str:
    if "mfu" in config:
        return config["mfu"]
    return f"MFU at {config['peak_tflops']:.0f} TFLOP/s"  # a probe.json from before the peak table


def _f(v, fmt, unit=""):
    return "" if v is None else format(v, fmt) + unit


PROBE_COLUMNS = ["backend", "runs here", "Linears converted", "final loss", "vs bf16", "tok/s", "speedup", "MFU",
                 "peak GiB", "micro-step ms", "step ms (tok/s)", "numerics canary"]


def to_markdown(out: dict) -> str:
    c = out["config"]
    lines = [f"# Precision probe: {out['device']}", "",
             f"torch {out['torch']}, Transformer Engine {out['te'] or 'not installed'}; depth {c['depth']} "
             f"(width {c['width']}), seq {c['seq_len']}, {c['tokens_per_step']} tokens/step, {c['steps']} steps, "
             f"data {c['data']}, {c['flops_per_token'] / 1e9:.2f} GFLOP/token; {_mfu_basis(c)}.",
             "tok/s, speedup and MFU are for the forward + backward micro-step (what a backend changes); the "
             "step column is the whole step with the optimizer (the same Muon + AdamW for every backend). Numerics canary: "
             f"gradients finite and not all zero layer by layer over the first {c.get('canary_steps', '?')} steps, "
             f"loss within ±{c.get('loss_band_pct', '?')}% of bf16's (model/precision/canary.py).",
             "", "| " + " | ".join(PROBE_COLUMNS) + " |", "|" + " --- |" * len(PROBE_COLUMNS)]
    blanks = " |" * (len(PROBE_COLUMNS) - 2)  # a row that did not run fills only its first two cells
    for r in out["results"]:
        label = r["label"] + (" (EMULATED)" if r["emulated"] else "")
        if not r["available"]:
            lines.append(f"| {label} | no: {r['reason']} |{blanks}")
        elif not r["ran"]:
            lines.append(f"| {label} | yes, but failed: {r.get('error')} |{blanks}")
        else:
            # the count shows a filter that left nothing to convert (say nvfp4's bf16 last blocks on a tiny model)
            lines.append(f"| {label} | yes | {_f(r.get('converted'), 'd')} | {r['final_loss']:.4f} | {_f(r.get('loss_diff_pct'), '+.2f', '%')} | "
                         f"{r['tokens_per_s']:,.0f} | {_f(r.get('speedup'), '.3f', 'x')} | {_f(r.get('mfu') and 100 * r['mfu'], '.1f', '%')} | "
                         f"{_f(r['peak_mem_gib'], '.1f')} | {r['micro_ms']:.0f} | {r['step_ms']:.0f} ({r['step_tokens_per_s']:,.0f}) | "
                         f"{r.get('canary', '')} |")
    return "\n".join(lines) + "\n"


