"""Property-based fuzzing of the OpenAI API from its own OpenAPI document, with schemathesis.

Runs schemathesis's own runner (`st run`: the examples, coverage and fuzzing phases, valid and
invalid requests, every check) against a live server, `--runs` times with seeds `--seed`, `--seed`+1,
..., with `model` pinned to the served name in nine requests of ten (bench/fuzz_hooks.py), so valid
requests reach generation. Every request and response is recorded (a HAR file) and counted here: the
gate is no 5xx in any run; schemathesis's own check failures (conformance to the document) are reported
too, and each count's median and range over the runs.

    python bench/fuzz_api.py                          # the real server over artifacts/model, 3 runs
    python bench/fuzz_api.py --examples 100 --out DIR # DIR/fuzz.json (every run and the summary),
                                                      # DIR/st-<seed>.txt; --har keeps requests-<seed>.har.gz

`fuzz()` is the library the test suite calls (tests/test_fuzz_api.py) against a server it started.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.stats import fmt, save_json, spread  # noqa: E402
from sparkchat import paths  # noqa: E402


def fuzz(base_url: str, model_id: str, examples: int, seed: int = 0, out: Path | None = None,
         timeout: float = 600, phases: str = "examples,coverage,fuzzing", har_out: bool = False) -> dict:
    """Run `st run` against the server at `base_url`; returns the counts (and writes st-<seed>.txt, and
    with `har_out` requests-<seed>.har.gz, into `out` when given)."""
    with tempfile.TemporaryDirectory() as tmp:
        har = Path(tmp).resolve() / "requests.har"
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "bench.fuzz_hooks", "SPARKCHAT_FUZZ_MODEL": model_id,
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{base_url}/openapi.json", "--checks", "all",
               "--phases", phases, "--mode", "all", "--max-examples", str(examples),
               "--seed", str(seed), "--continue-on-failure", "--request-timeout", "120", "--no-color",
               "--report", "har", "--report-har-path", str(har)]
        t = time.perf_counter()
        # in a fresh folder: schemathesis keeps the failures it found (.schemathesis/) and replays them
        # first next time; each run starts from nothing, so a seed gives the same run
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        seconds = time.perf_counter() - t
        if out:
            (Path(out) / f"st-{seed}.txt").write_text("$ " + " ".join(cmd[1:]) + "\n\n" + proc.stdout + proc.stderr)
        if not har.is_file():
            raise RuntimeError(f"schemathesis wrote no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        entries = json.loads(har.read_text())["log"]["entries"]
        if out and har_out:  # every request and response, compressed (~20x)
            with open(har, "rb") as f, gzip.open(Path(out) / f"requests-{seed}.har.gz", "wb", compresslevel=9) as g:
                shutil.copyfileobj(f, g)
    operations: dict = collections.defaultdict(collections.Counter)
    server_errors, generated, refused = [], 0, collections.Counter()
    for e in entries:
        req, res = e["request"], e["response"]
        path = urlsplit(req["url"]).path
        path = "/v1/models/{model_id}" if path.startswith("/v1/models/") else path
        label, status = f"{req['method']} {path}", res["status"]
        operations[label][str(status)] += 1
        if status >= 500 or status == 0:
            server_errors.append({"operation": label, "status": status, "body": req.get("postData", {}).get("text", "")[:500]})
        elif status == 200 and req["method"] == "POST":
            generated += 1
        elif status >= 400:
            try:
                param = json.loads(res["content"]["text"])["error"]["param"]
            except Exception:
                param = "?"
            refused[f"{label} {status} {param}"] += 1
    summary = [line for line in proc.stdout.splitlines() if line.strip()][-12:]
    failures = sorted({line.split()[1] for line in proc.stdout.splitlines() if line.strip().startswith("❌ ST")})
    return {"seed": seed, "requests": len(entries), "generated": generated, "server_errors": server_errors,
            "operations": {k: dict(sorted(v.items())) for k, v in sorted(operations.items())},
            "refused": dict(refused.most_common()), "schemathesis_exit": proc.returncode,
            "schemathesis_failures": failures,
            "schemathesis_summary": summary, "seconds": round(seconds, 1)}


def summarise(runs: list[dict]) -> dict:
    """Each count's median and range over the runs; the gate holds when no run had a server error."""
    return {"runs": len(runs), "requests": spread([r["requests"] for r in runs], 0),
            "generated": spread([r["generated"] for r in runs], 0),
            "server_errors": spread([len(r["server_errors"]) for r in runs], 0),
            "no_server_errors": all(not r["server_errors"] for r in runs),
            "schemathesis_failures": sorted({f for r in runs for f in r["schemathesis_failures"]})}


def main(argv=None) -> dict:
    from bench.serve import running_server

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(paths.CHAT_MODEL), help="model directory (default: %(default)s)")
    ap.add_argument("--served-model-name", default="sparkchat")
    ap.add_argument("--examples", type=int, default=300,
                    help="schemathesis's --max-examples, per operation and phase (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="runs, with seeds --seed, --seed+1, ... (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write fuzz.json and each run's st-<seed>.txt here")
    ap.add_argument("--har", action="store_true", help="with --out: also every request and response (requests-<seed>.har.gz)")
    args = ap.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"{args.model} is not a model directory: run the pipeline first, or pass --model")
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    argv = ["-m", "serve", "--model", args.model, "--device", "cpu", "--max-batch", "16", "--max-queue", "64",
            "--served-model-name", args.served_model_name]
    runs = []
    with running_server(argv) as (base, _):
        for i in range(args.runs):
            r = fuzz(base, args.served_model_name, args.examples, args.seed + i, args.out, timeout=3600, har_out=args.har)
            runs.append(r)
            print(f"run {i + 1}/{args.runs} (seed {r['seed']}): {r['requests']} requests ({r['generated']} generated a "
                  f"reply) in {r['seconds']} s; server errors: {len(r['server_errors'])}; schemathesis exit "
                  f"{r['schemathesis_exit']}", flush=True)
    stats = {"examples": args.examples, "model": str(args.model), "summary": summarise(runs), "runs": runs}
    s = stats["summary"]
    print(f"{s['runs']} runs: requests {fmt(s['requests'], ',.0f')}, reached generation {fmt(s['generated'], ',.0f')}, "
          f"server errors {fmt(s['server_errors'], ',.0f')}; schemathesis's check failures: "
          f"{', '.join(s['schemathesis_failures']) or 'none'}")
    if args.out:
        save_json(stats, args.out / "fuzz.json", indent=1)
    return stats


if __name__ == "__main__":
    main()
