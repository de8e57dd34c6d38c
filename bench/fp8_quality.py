"""What FP8 serving weights cost in quality: the evaluate stage's scores of one model held as the server
holds it, bf16 against `--weights fp8` (model/precision/fp8_weights.py), task by task.

Runs in a project where the pipeline has run (its evaluation items and validation tokens, params.yaml with
the profile it ran under: `dvc exp run -S profile=h200-small`, or the default), on a GPU with FP8
tensor cores. Both sides score with pipeline.evaluate.evaluate_model, the stage's own code, the model's
other parts in bf16. Greedy decoding and fixed items: one run each is the figure (no timing to repeat).
The gate: every task's score within `--tolerance` (0.02) of bf16's; val_bpb is shown beside them.

    python -m bench.fp8_quality [--model rl] [--out bench/results/serving/fp8_quality_<profile>.json]
"""
from __future__ import annotations

import argparse
import sys
import time

TOLERANCE = 0.02
NOT_A_SCORE = ("val_bpb",)  # bits per byte, not an accuracy: shown, not gated


def compare(bf16: dict, fp8: dict, tolerance: float = TOLERANCE) -> dict:
    """Task by task: both scores, fp8 - bf16, and whether every task's difference is within `tolerance`."""
    tasks = {t: {"bf16": bf16[t], "fp8": fp8[t], "difference": round(fp8[t] - bf16[t], 4)}
             for t in bf16 if t in fp8}
    missing = sorted(set(bf16) ^ set(fp8))
    worst = max((abs(v["difference"]) for t, v in tasks.items() if t not in NOT_A_SCORE), default=0.0)
    return {"tasks": tasks, "missing": missing, "largest_difference": round(worst, 4), "tolerance": tolerance,
            "within_tolerance": worst <= tolerance and not missing}


def main(argv=None) -> dict:
    import torch

    from bench.provenance import run_id
    from bench.stats import save_json
    from model.device import resolve_device
    from model.model_dir import load_model_dir
    from model.precision import fp8_weights
    from pipeline.config import load_params
    from pipeline.evaluate import evaluate_model, load_benchmarks
    from sparkchat import paths

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="rl", choices=list(paths.EVAL_MODELS),
                    help="which of the pipeline's models (default: %(default)s, the served one)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="(default: %(default)s)")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)
    p = load_params(stage="evaluate")
    device = resolve_device(p.runtime.device)
    reason = fp8_weights.unavailable_reason(device)
    if reason:
        raise SystemExit(f"bench/fp8_quality.py: {reason}")
    benches = load_benchmarks(p)
    path = paths.EVAL_MODELS[args.model]
    loads = {"bf16": load_model_dir, "fp8": fp8_weights.load_model_dir}
    scores = {w: evaluate_model(args.model, path, p, device, benches, dtype=torch.bfloat16, load=load)
              for w, load in loads.items()}
    res = {"command": "python -m bench.fp8_quality " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": run_id(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": str(path),
           "profile": getattr(p, "profile", None), **compare(scores["bf16"], scores["fp8"], args.tolerance)}
    for t, v in res["tasks"].items():
        print(f"{t:>16}: bf16 {v['bf16']:.4f}  fp8 {v['fp8']:.4f}  ({v['difference']:+.4f})")
    print(f"largest difference {res['largest_difference']} (tolerance {args.tolerance}): "
          f"{'within' if res['within_tolerance'] else 'NOT within'}", flush=True)
    save_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
