"""The probe, repeated: every backend's speed and loss against bf16 as the median and range of runs.

`sparkchat probe` times one run. This runs it `--runs` times, each in a process of its own (compile
caches aside, nothing carries over), and reports per entry the median and range of: the micro-step's
tokens/s, the whole step's (optimizer included), the speedup against bf16 *of the same run*, the final
loss and its difference from that run's bf16, and peak memory. An entry that did not run in some run
(not available here, out of memory) is reported with its reasons and without figures.

    python -m bench.probe_spread --out DIR -- --depth 20 --seq-len 2048 --batch 32 --vocab 65536 \\
        --steps 200 --backends bf16 fp8 te-fp8:delayed
    python -m bench.probe_spread --summarise DIR/run-*/probe.json --out DIR    # runs made elsewhere

Everything after `--` goes to `sparkchat probe` (`python -m pipeline.probe --help`); DIR/run-<i>/ holds
each run's probe.json and probe.md, DIR/probe_spread.json and .md the summary.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .stats import fmt, save_json, spread

ROOT = Path(__file__).resolve().parent.parent
FIGURES = {  # summary key: (probe.json field, digits)
    "tokens_per_s": ("tokens_per_s", 0), "step_tokens_per_s": ("step_tokens_per_s", 0),
    "speedup": ("speedup", 4), "final_loss": ("final_loss", 4), "loss_diff_pct": ("loss_diff_pct", 3),
    "peak_mem_gib": ("peak_mem_gib", 1),
}


def summarise(probes: list[dict]) -> dict:
    """One entry per label over the runs' probe.json contents (each run's ratios are its own)."""
    devices = {p["device"] for p in probes}
    if len(devices) > 1:
        raise ValueError(f"probes of different devices cannot be summarised together: {sorted(devices)}")
    labels = list(dict.fromkeys(r["label"] for p in probes for r in p["results"]))
    entries = []
    for label in labels:
        rows = [r for p in probes for r in p["results"] if r["label"] == label]
        ran = [r for r in rows if r.get("ran")]
        e = {"label": label, "runs": len(rows), "ran": len(ran),
             "reasons": sorted({str(r.get("reason") or r.get("error")) for r in rows if not r.get("ran")})}
        for key, (field, digits) in FIGURES.items():
            vals = [r[field] for r in ran if r.get(field) is not None]
            if vals:
                e[key] = spread(vals, digits)
        entries.append(e)
    return {"device": devices.pop(), "config": probes[0]["config"], "runs": len(probes), "entries": entries}


def to_markdown(s: dict) -> str:
    c = s["config"]
    lines = [f"Probe on {s['device']}, {s['runs']} runs: depth {c['depth']}, {c['batch']} x {c['seq_len']} tokens a "
             f"micro-step, {c['steps']} steps, vocab {c['vocab']}. Median (min-max) over the runs; speedup and loss "
             "difference against bf16 of the same run.", "",
             "| entry | ran | tokens/s (micro-step) | vs bf16 | whole step tokens/s | final loss | vs bf16 | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in s["entries"]:
        if not e["ran"]:
            lines.append(f"| {e['label']} | 0 of {e['runs']} | {'; '.join(e['reasons'])[:200]} | | | | | |")
            continue
        cell = lambda k, spec, unit="": fmt(e[k], spec, unit) if k in e else ""  # noqa: E731
        lines.append(f"| {e['label']} | {e['ran']} of {e['runs']} | {cell('tokens_per_s', ',.0f')} | "
                     f"{cell('speedup', '.3f', 'x')} | {cell('step_tokens_per_s', ',.0f')} | {cell('final_loss', '.4f')} | "
                     f"{cell('loss_diff_pct', '+.2f', '%')} | {cell('peak_mem_gib', '.1f')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    probe_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(prog="python -m bench.probe_spread", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="probe runs, each its own process (default: %(default)s)")
    ap.add_argument("--out", type=Path, required=True, help="folder for run-<i>/ and probe_spread.json/.md")
    ap.add_argument("--summarise", nargs="+", type=Path, metavar="PROBE_JSON",
                    help="run nothing: summarise these probe.json files")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.summarise:
        paths = a.summarise
    else:
        if a.runs < 1:
            ap.error("--runs must be at least 1")
        paths = []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        for i in range(1, a.runs + 1):
            run_dir = a.out / f"run-{i}"
            print(f"probe run {i} of {a.runs} -> {run_dir}", flush=True)
            rc = subprocess.call([sys.executable, "-m", "pipeline.probe", *probe_args, "--out", str(run_dir)], cwd=ROOT, env=env)
            if rc != 0:
                sys.exit(f"probe run {i} failed (exit code {rc}); the runs before it are in {a.out}")
            paths.append(run_dir / "probe.json")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        sys.exit(f"no probe.json at {', '.join(missing)}")
    summary = summarise([json.loads(p.read_text()) for p in paths])
    summary["files"] = [str(p) for p in paths]
    a.out.mkdir(parents=True, exist_ok=True)
    save_json(summary, a.out / "probe_spread.json", indent=1)
    md = to_markdown(summary)
    (a.out / "probe_spread.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
