"""One benchmark run in two trees in turn (A B A B ...), `--runs` times each, so that a change is measured
against the tree before it on a machine whose speed drifts by more than most changes move a figure.

Each run is the benchmark command as a user runs it, started in its tree (`PYTHONPATH` that tree, so
its own code runs) with `--out` added; the JSON it writes is kept whole under `runs`, and for each
`--keys` path (dotted, into the run's JSON, e.g. `http.128.of_engine`: a figure's median) the median
and range over that tree's runs go under `summary`, with B's over A's per alternated pair.

    python -m bench.alternate --a ../old --b . --runs 3 --keys http.128.of_engine --out FILE -- \\
        python -m bench.serve_gpu --device cpu --depth 2 --http --levels 16,128
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.stats import ratios, save_json, spread


def figure(data: dict, path: str) -> float:
    """The number at a dotted path (a {median, min, max} figure gives its median)."""
    for part in path.split("."):
        data = data[part]
    return float(data["median"] if isinstance(data, dict) else data)


def tree_commit(tree: Path) -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree, capture_output=True,
                           text=True).stdout.strip()
    return (out.stdout.strip() + ("+dirty" if dirty else "")) if out.returncode == 0 else None


def run_in(tree: Path, command: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run([*command, "--out", str(out)], cwd=tree, env=env, check=True)
        return json.loads(out.read_text())


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("bench.alternate: give the benchmark's command after --")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, type=Path, help="the reference tree")
    ap.add_argument("--b", required=True, type=Path, help="the tree measured against it")
    ap.add_argument("--runs", type=int, default=3, help="runs of each tree, alternated (default: %(default)s)")
    ap.add_argument("--keys", required=True, help="dotted paths of the figures to summarise, comma-separated")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv[:cut])
    command, keys = argv[cut + 1:], args.keys.split(",")
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    runs: list[dict] = []
    for i in range(args.runs):
        for side, tree in trees.items():
            print(f"run {i + 1}/{args.runs}: {side} ({tree})", flush=True)
            runs.append({"side": side, "run": i + 1, "result": run_in(tree, command)})
    per = {side: [r["result"] for r in runs if r["side"] == side] for side in trees}
    summary = {k: {"a": spread(figure(r, k) for r in per["a"]), "b": spread(figure(r, k) for r in per["b"]),
                   "b_over_a": spread(ratios([figure(r, k) for r in per["b"]], [figure(r, k) for r in per["a"]]))}
               for k in keys}
    res = {"trees": {side: {"path": str(tree), "commit": tree_commit(tree)} for side, tree in trees.items()},
           "benchmark": " ".join(command), "summary": summary, "runs": runs}
    for k, s in summary.items():
        print(f"{k}: a {s['a']['median']} ({s['a']['min']}-{s['a']['max']}), b {s['b']['median']} "
              f"({s['b']['min']}-{s['b']['max']}), b/a {s['b_over_a']['median']}")
    save_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
