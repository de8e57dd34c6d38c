"""sparkchat's pretrain loop against nanochat's `base_train`, head to head on one machine.

Both train the same depth, device batch, total batch and sequence length on the same token stream (the
same rows in the same order: nanochat's data loaders are replaced by our `TokenStream` over our token
files), each with its own model code, optimizer settings and schedule, in a process of its own, bf16 and
each one's FP8 (ours: `precision.backend=fp8`; nanochat's: `--fp8`, its tensorwise recipe), in alternated
rounds. Per run: every whole step's time (forward, backward, optimizer, the host reading the loss; both
loops synchronise every step), and the validation bits per byte on the same held-out bytes (our token
files' val split and our tokenizer's bytes per token, for both) every `--eval-every` steps. Reported:
whole-step tokens/s (its median over the last half of the steps: trained weights), sparkchat / nanochat
ratios, fp8 / bf16, and each run's val bpb at equal training time (marks at fractions of the shortest
run's training time; evaluation time not counted, compile time counted).

nanochat is not part of the project: `export` copies the pinned commit's files from a git mirror into
bench/peers/nanochat/ (git-ignored), which a GPU host receives as files. nanochat's `base_train.py` runs
unchanged through runpy with three things replaced from outside: its tokenizer (ours, which the token
files were made with; its own needs the `rustbpe` package and a trained tokenizer file), its data loaders
(ours, above), and, where not installed, empty stand-ins for the packages it imports but does not use
here (`wandb` under `--run dummy`; `rustbpe` and `tiktoken`, its tokenizer's). Its attention runs full-context (`--window-pattern L`):
without Flash Attention 3 (a hub download), its default sliding windows fall back to a slow path, and
ours is full-context. Its `print0` lines are read for each step's `dt` and each `Validation bpb`.

Text: `--text shakespeare` (the pipeline's default corpus, repeated when a run needs more) or `--text
corpus` (bench/corpus.py: documents drawn from the offline sources' real words, as large as the run
needs); the tokenizer is bench/text_model.py's, exactly `--vocab` ids.

    python -m bench.vs_nanochat export --from /path/to/nanochat.git        # once, where a mirror is
    python -m bench.vs_nanochat run --depth 20 --steps 1000 --out bench/results/precision/vs_nanochat_d20.json
    python -m bench.vs_nanochat check bench/results/precision/vs_nanochat_d*.json

The GPU recipe: bench/gpu/vs_nanochat.sh.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from datetime import datetime, timezone
from pathlib import Path

from bench.check_keys import check_files
from bench.provenance import run_id

ROOT = Path(__file__).resolve().parent.parent
NANOCHAT_REPO = "https://github.com/karpathy/nanochat"
NANOCHAT_COMMIT = "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd"  # 2026-07-03, "clean up fragile code"
PEER_DIR = ROOT / "bench" / "peers" / "nanochat"
IMPLS = ("sparkchat", "nanochat")
PRECISIONS = ("bf16", "fp8")
# what the raw JSON of the GPU runs must carry (issue 56); `check` reads them (bench/check_keys.py, the
# per-precision mappings counting as figures)
REQUIRED_KEYS = ("over_nanochat_tokens_per_s", "fp8_over_bf16_whole_step_d20", "fp8_loss_gap_pct", "steps", "commit",
                 "date")
MARKS = 4  # equal-time marks: 1/4, 2/4, 3/4 and all of the shortest run's training time


# -- the peer's files ------------------------------------------------------------------------------

def export(git_dir: str, out: Path = PEER_DIR) -> Path:
    """The pinned commit's files from a git repository (a clone or a bare mirror) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tar:
        subprocess.run(["git", "--git-dir", git_dir, "archive", "--format=tar", NANOCHAT_COMMIT], stdout=tar, check=True)
        tar.seek(0)
        with tarfile.open(fileobj=tar) as t:
            t.extractall(out, filter="data")
    (out / "COMMIT").write_text(NANOCHAT_COMMIT + "\n")
    return out


def peer_dir(path: Path = PEER_DIR) -> Path:
    """The exported peer, checked to be the pinned commit's."""
    stamp = path / "COMMIT"
    if not stamp.is_file():
        raise SystemExit(f"no nanochat at {path}: run `python -m bench.vs_nanochat export --from <nanochat git dir>` "
                         f"(a clone of {NANOCHAT_REPO}) first")
    if stamp.read_text().strip() != NANOCHAT_COMMIT:
        raise SystemExit(f"{path} holds nanochat {stamp.read_text().strip()}, not the pinned {NANOCHAT_COMMIT}: export again")
    return path


# -- the shared data --------------------------------------------------------------------------------

def base_params(a) -> dict:
    """params.yaml with this comparison's shape and schedule (what every sparkchat run reads)."""
    import yaml
    d = yaml.safe_load((ROOT / "params.yaml").read_text())
    d["model"].update(depth=a.depth, head_dim=a.head_dim, seq_len=a.seq_len, aspect_ratio=64, kv_head_ratio=1)
    d["tokenizer"]["vocab_size"] = a.vocab
    d["runtime"].update(device=a.device, memory_fit="off")  # the batch is decided once for both (`run`)
    d["pretrain"].update(steps=a.steps, total_batch_tokens=a.total_batch, device_batch=a.batch, eval_every=a.eval_every,
                         eval_tokens=a.eval_tokens, log_every=1, checkpoint_every=a.steps + 1)
    return d


def prepare(a, work: Path) -> dict:
    """The tokenizer and token files both implementations read, in `work` (a sparkchat project layout)."""
    from pipeline.config import params_from_dict
    from pipeline.prepare import prepare_pretrain, pretrain_token_budget
    from pipeline.tokenize import tokenize_pretrain
    from sparkchat import paths

    from .corpus import write_corpus
    from .text_model import text_tokenizer
    os.chdir(work)
    d = base_params(a)
    p = params_from_dict(d, ROOT / "profiles")
    if a.text == "corpus":
        folder = work / "corpus"
        if not folder.is_dir():
            write_corpus(int(pretrain_token_budget(p) * 4.5), folder / "", seed=0)  # ~4.5 bytes a token of text
        d["data"]["pretrain_sources"] = [str(folder)]
        p = params_from_dict(d, ROOT / "profiles")
    if not (paths.PRETRAIN_TOKENS / "index.json").is_file():
        tok = text_tokenizer(a.vocab)
        paths.TOKENIZER.parent.mkdir(parents=True, exist_ok=True)
        tok.save(paths.TOKENIZER)
        prepare_pretrain(p, paths.PRETRAIN_SHARDS)
        tokenize_pretrain(tok, paths.PRETRAIN_SHARDS, paths.PRETRAIN_TOKENS)
    return json.loads((paths.PRETRAIN_TOKENS / "index.json").read_text())


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- one run, in its own process ------------------------------------------------------------------

def run_sparkchat(a, work: Path) -> dict:
    """sparkchat's pretrain stage (pipeline/train.py, unchanged) with every step and evaluation timed."""
    import pipeline.train as T
    from pipeline.config import params_from_dict
    os.chdir(work)
    d = base_params(a)
    d["precision"]["backend"] = a.precision
    p = params_from_dict(d, ROOT / "profiles")
    rec = dict(dt=[], loss=[], evals=[])
    step_fn, eval_fn = T.optimizer_step, T.evaluate_bpb

    def timed_step(run, model, autocast, idle):
        _sync(a.device)
        t0 = time.perf_counter()
        loss_sum = step_fn(run, model, autocast, idle)
        rec["loss"].append(float(loss_sum) / run.grad_accum)  # the host reads it, as the loop's logged step does
        _sync(a.device)
        rec["dt"].append(time.perf_counter() - t0)
        return loss_sum

    def timed_eval(*args, **kw):
        bpb = eval_fn(*args, **kw)
        rec["evals"].append([len(rec["dt"]), bpb])
        return bpb

    T.optimizer_step, T.evaluate_bpb = timed_step, timed_eval
    T.train("pretrain", p)
    return rec


STEP_LINE = re.compile(r"^step (\d+)/\d+ .*\| loss: ([\d.]+) .*\| dt: ([\d.]+)ms")
EVAL_LINE = re.compile(r"^Step (\d+) \| Validation bpb: ([\d.]+)")


def parse_nanochat(lines: list[str]) -> dict:
    """Each step's dt (s) and smoothed loss, and each validation's (steps done, bpb), from base_train's lines."""
    rec = dict(dt=[], loss=[], evals=[])
    for line in lines:
        if m := STEP_LINE.match(line):
            rec["dt"].append(float(m[3]) / 1e3)
            rec["loss"].append(float(m[2]))
        elif m := EVAL_LINE.match(line):
            rec["evals"].append([int(m[1]), float(m[2])])
    return rec


def run_nanochat(a, work: Path) -> dict:
    """nanochat's scripts/base_train.py at the pinned commit, on our tokens (the module docstring says how)."""
    import importlib

    import torch

    from model.loss_eval import token_bytes
    from model.tokenizer import SparkTokenizer
    from pipeline.data import TokenStream, open_tokens
    from sparkchat import paths
    peer = peer_dir(Path(a.peer))
    os.chdir(work)
    os.environ["NANOCHAT_BASE_DIR"] = str(work / "nanochat_base")  # its checkpoint at the end goes here
    for name in ("wandb", "rustbpe", "tiktoken"):  # imported at its top, unused here (module docstring)
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
    sys.path.insert(0, str(peer))
    common, tokenizer, loader = (importlib.import_module(f"nanochat.{m}") for m in ("common", "tokenizer", "dataloader"))
    tok = SparkTokenizer.load(paths.TOKENIZER)
    device = torch.device(a.device)

    class Tokenizer:  # what base_train asks of its tokenizer with sampling and CORE off
        def get_vocab_size(self):
            return tok.vocab_size

        def get_bos_token_id(self):
            return tok.bos_id

    def stream(split, batch):
        return TokenStream(open_tokens(split, tok).ids, batch, a.seq_len, 0, 1, device)

    def train_loader(_tok, batch, seq_len, split="train", device=None, resume_state_dict=None):
        s = stream(paths.PRETRAIN_TRAIN_TOKENS, batch)
        while True:
            x, y = s.next()
            yield x, y, {"epoch": s.consumed // s.batches_per_epoch, "pq_idx": 0, "rg_idx": 0}

    def val_loader(_tok, batch, seq_len, split="val", device=None):
        s = stream(paths.PRETRAIN_VAL_TOKENS, batch)
        while True:
            yield s.next()

    tokenizer.get_tokenizer = lambda: Tokenizer()
    tokenizer.get_token_bytes = lambda device="cpu": token_bytes(tok, device).long()  # its sums are integer
    loader.tokenizing_distributed_data_loader_with_state_bos_bestfit = train_loader
    loader.tokenizing_distributed_data_loader_bos_bestfit = val_loader
    lines, print0 = [], common.print0

    def recording_print0(s="", **kw):
        lines.append(str(s))
        print0(s, **kw)

    common.print0 = recording_print0
    sys.argv = ["base_train.py", "--run", "dummy", "--device-type", device.type, "--depth", str(a.depth),
                "--head-dim", str(a.head_dim), "--aspect-ratio", "64", "--max-seq-len", str(a.seq_len),
                "--window-pattern", "L", "--num-iterations", str(a.steps), "--device-batch-size", str(a.batch),
                "--total-batch-size", str(a.total_batch), "--eval-every", str(a.eval_every), "--eval-tokens",
                str(a.eval_tokens), "--core-metric-every", "-1", "--sample-every", "-1"] + (["--fp8"] if a.precision == "fp8" else [])
    runpy.run_path(str(peer / "scripts" / "base_train.py"), run_name="__main__")
    rec = parse_nanochat(lines)
    if len(rec["dt"]) != a.steps:
        raise SystemExit(f"read {len(rec['dt'])} step lines of nanochat's {a.steps}: its log format changed?")
    return rec


# -- the comparison ----------------------------------------------------------------------------------

def summarise_run(rec: dict, tokens_per_step: int) -> dict:
    """Whole-step tokens/s (median after warm-up, and over the last half: trained weights), training time
    at each evaluation, and the final val bpb."""
    dt = rec["dt"]
    warm = max(1, min(10, len(dt) // 5))
    cum = [0.0]
    for t in dt:
        cum.append(cum[-1] + t)
    evals = [dict(step=s, train_s=round(cum[s], 3), bpb=b) for s, b in rec["evals"]]
    return dict(tokens_per_s=tokens_per_step / statistics.median(dt[warm:]),
                tokens_per_s_trained=tokens_per_step / statistics.median(dt[len(dt) // 2:]),
                train_s=cum[-1], final_bpb=evals[-1]["bpb"] if evals else None, evals=evals,
                step_ms=[round(t * 1e3, 3) for t in dt], loss=rec["loss"])


def bpb_at(run: dict, seconds: float) -> float | None:
    """The val bpb of the last evaluation made within `seconds` of training time (None before the first)."""
    done = [e for e in run["evals"] if e["train_s"] <= seconds + 1e-9 and e["step"] > 0]
    return done[-1]["bpb"] if done else None


def compare(rounds: list[dict], depth: int) -> dict:
    """Per-round ratios and equal-time val bpb, as median and range over the rounds (bench/stats.py)."""
    from .stats import spread
    out: dict = {}
    have = lambda r, *keys: all(k in r for k in keys)  # noqa: E731
    for prec in PRECISIONS:
        pair = [r for r in rounds if have(r, f"sparkchat-{prec}", f"nanochat-{prec}")]
        if pair:
            out.setdefault("over_nanochat_tokens_per_s", {})[prec] = spread(
                r[f"sparkchat-{prec}"]["tokens_per_s_trained"] / r[f"nanochat-{prec}"]["tokens_per_s_trained"] for r in pair)
    for impl in IMPLS:
        both = [r for r in rounds if have(r, f"{impl}-bf16", f"{impl}-fp8")]
        if both:
            key = f"fp8_over_bf16_whole_step_d{depth}" + ("" if impl == "sparkchat" else "_nanochat")
            out[key] = spread(r[f"{impl}-fp8"]["tokens_per_s_trained"] / r[f"{impl}-bf16"]["tokens_per_s_trained"]
                              for r in both)
            gap = [100 * (r[f"{impl}-fp8"]["final_bpb"] - r[f"{impl}-bf16"]["final_bpb"]) / r[f"{impl}-bf16"]["final_bpb"]
                   for r in both if r[f"{impl}-fp8"]["final_bpb"] and r[f"{impl}-bf16"]["final_bpb"]]
            if gap:
                out["fp8_loss_gap_pct" + ("" if impl == "sparkchat" else "_nanochat")] = spread(gap)
    # val bpb at equal training time: marks at fractions of each round's shortest run
    marks = {}
    for r in rounds:
        shortest = min(v["train_s"] for v in r.values())
        for k in range(1, MARKS + 1):
            for name, v in r.items():
                b = bpb_at(v, shortest * k / MARKS)
                if b is not None:
                    marks.setdefault(f"{k}/{MARKS}", {}).setdefault(name, []).append(b)
    out["val_bpb_at_equal_time"] = {m: {n: spread(v) for n, v in by.items()} for m, by in marks.items()}
    return out


def child_command(a, impl: str, precision: str, record: Path) -> list[str]:
    keep = ["--depth", a.depth, "--head-dim", a.head_dim, "--seq-len", a.seq_len, "--vocab", a.vocab, "--batch", a.batch,
            "--total-batch", a.total_batch, "--steps", a.steps, "--eval-every", a.eval_every, "--eval-tokens",
            a.eval_tokens, "--device", a.device, "--text", a.text, "--work", a.work, "--peer", a.peer]
    return [sys.executable, "-m", "bench.vs_nanochat", "one", "--impl", impl, "--precision", precision,
            "--record", str(record)] + [str(x) for x in keep]


def run(a) -> dict:
    """Prepare once, then every variant in its own process, alternated over `--runs` rounds."""
    import torch

    from model.memory_fit import fit_batch, Shape
    from model.precision.probe import model_config
    from model.gpt import GPT
    from .stats import save_json
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    a.work = str(work)
    if a.device.startswith("cuda"):  # one batch for both, the most of --batch that fits this card
        with torch.device("meta"):
            shape = Shape.of(GPT(model_config(a.depth, a.seq_len, a.vocab, a.head_dim)))
        free, total = torch.cuda.mem_get_info()
        a.batch = fit_batch(a.batch, shape, free) or a.batch
    micro = a.batch * a.seq_len  # base_train asserts a whole number of micro-steps a step
    a.total_batch = max(1, a.total_batch // micro) * micro
    if "nanochat" in a.impls:
        peer_dir(Path(a.peer))
    index = prepare(a, work)
    os.chdir(ROOT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    if not a.device.startswith("cuda"):
        env["TORCHDYNAMO_DISABLE"] = "1"  # nanochat compiles on any device; a CPU smoke run need not
    rounds, res = [], {}
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    for i in range(a.runs):
        order = [(impl, prec) for prec in a.precisions for impl in a.impls]
        if i % 2:
            order.reverse()  # alternated: neither side always runs first on a warming machine
        rnd = {}
        for impl, prec in order:
            record = work / f"record-{impl}-{prec}-{i}.json"
            print(f"round {i + 1}/{a.runs}: {impl} {prec}", file=sys.stderr, flush=True)
            subprocess.run(child_command(a, impl, prec, record), check=True, env=env, cwd=ROOT)
            rnd[f"{impl}-{prec}"] = summarise_run(json.loads(record.read_text()), a.total_batch)
        rounds.append(rnd)
        res = dict(bench="vs_nanochat", commit=run_id(), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   command=" ".join(sys.argv), device=device, torch=torch.__version__, nanochat=dict(
                       repo=NANOCHAT_REPO, commit=NANOCHAT_COMMIT, window_pattern="L"),
                   steps=a.steps, config=dict(depth=a.depth, head_dim=a.head_dim, seq_len=a.seq_len, vocab=a.vocab,
                                              device_batch=a.batch, total_batch_tokens=a.total_batch, eval_every=a.eval_every,
                                              eval_tokens=a.eval_tokens, runs=a.runs),
                   text=("the pipeline's default corpus (builtin:shakespeare)" if a.text == "shakespeare" else
                         "bench/corpus.py: documents of real words drawn from the offline sources"),
                   tokens=dict(train=index["splits"]["train"]["tokens"], val=index["splits"]["val"]["tokens"]),
                   **compare(rounds, a.depth), rounds=rounds)
        save_json(res, a.out)  # after every round: a run cut short keeps the rounds that finished
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.vs_nanochat", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="copy the pinned nanochat commit's files into bench/peers/nanochat/")
    ex.add_argument("--from", dest="git_dir", required=True, help="a clone or mirror of " + NANOCHAT_REPO)
    ck = sub.add_parser("check", help="the raw JSON of the runs carries every key issue 56 asks for")
    ck.add_argument("files", nargs="+")
    for name in ("run", "one"):
        p = sub.add_parser(name, help="the comparison" if name == "run" else "one variant (run starts these)")
        p.add_argument("--depth", type=int, default=20)
        p.add_argument("--head-dim", type=int, default=128)
        p.add_argument("--seq-len", type=int, default=2048)
        p.add_argument("--vocab", type=int, default=65536)
        p.add_argument("--batch", type=int, default=32, help="device batch (halved to fit the GPU, the same for both)")
        p.add_argument("--total-batch", type=int, default=524288, help="tokens a step (gradient accumulation)")
        p.add_argument("--steps", type=int, default=1000)
        p.add_argument("--eval-every", type=int, default=100)
        p.add_argument("--eval-tokens", type=int, default=4 * 524288)
        p.add_argument("--device", default="cuda")
        p.add_argument("--text", choices=["shakespeare", "corpus"], default="corpus")
        p.add_argument("--work", default="/tmp/sparkchat-bench/vs_nanochat", help="data and runs (default: %(default)s)")
        p.add_argument("--peer", default=str(PEER_DIR), help="the exported nanochat (default: %(default)s)")
        if name == "run":
            p.add_argument("--runs", type=int, default=3)
            p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
            p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
            p.add_argument("--out", help="the raw JSON (bench/stats.py save_json)")
        else:
            p.add_argument("--impl", choices=IMPLS, required=True)
            p.add_argument("--precision", choices=PRECISIONS, required=True)
            p.add_argument("--record", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "export":
        print(export(a.git_dir))
    elif a.cmd == "check":
        raise SystemExit(check_files(a.files, REQUIRED_KEYS, per_variant=True))
    elif a.cmd == "one":
        rec = (run_sparkchat if a.impl == "sparkchat" else run_nanochat)(a, Path(a.work))
        Path(a.record).write_text(json.dumps(rec))
    else:
        res = run(a)
        print(json.dumps({k: v for k, v in res.items() if k not in ("rounds",)}, indent=1))


if __name__ == "__main__":
    main()
