"""How every benchmark here reports a figure: the median of its runs or rounds with their range.

Never the best of N: on a shared machine the best round is the one that ran alone, which a user will
not see. A ratio is taken within one round (both sides measured back to back), and its spread is the
spread of those per-round ratios.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Iterable


def spread(values: Iterable[float], digits: int = 4) -> dict:
    """{"median", "min", "max", "n"} of the values (at least one)."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("spread() of no values: a benchmark round produced nothing to report")
    return {"median": round(statistics.median(vals), digits), "min": round(min(vals), digits),
            "max": round(max(vals), digits), "n": len(vals)}


def fmt(s: dict, spec: str = ",.1f", unit: str = "") -> str:
    """`median (min–max)`, the form the results pages use (an en dash, so negative bounds read)."""
    return f"{s['median']:{spec}}{unit} ({s['min']:{spec}}–{s['max']:{spec}}{unit})"


def ratios(num: list[float], den: list[float]) -> list[float]:
    """Per-round ratios num[i] / den[i]: both sides of each measured in the same round."""
    if len(num) != len(den):
        raise ValueError(f"ratios of {len(num)} and {len(den)} rounds: each round needs both sides")
    return [n / d for n, d in zip(num, den)]


def speedup(ref: list[float], other: list[float], digits: int = 4) -> dict:
    """How many times faster `other` ran than `ref`, from the times of rounds that were not paired (one
    measured after the other): the ratio of the medians, its range over every pair of rounds."""
    return {"median": round(statistics.median(ref) / statistics.median(other), digits),
            "min": round(min(ref) / max(other), digits), "max": round(max(ref) / min(other), digits),
            "n": min(len(ref), len(other))}


def dumps(x, indent: int = 2, width: int = 100, _level: int = 0) -> str:
    """JSON, indented, but a list or object whose one-line form fits in `width` stays on one line: a
    round's figures or a step's losses read as a row, and raw files stay a few lines long in git."""
    flat = json.dumps(x, ensure_ascii=False)
    if not isinstance(x, (dict, list)) or not x or len(flat) + indent * _level <= width:
        return flat
    pad, inner = " " * indent * _level, " " * indent * (_level + 1)
    if isinstance(x, dict):
        body = [f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {dumps(v, indent, width, _level + 1)}"
                for k, v in x.items()]
        return "{\n" + ",\n".join(body) + "\n" + pad + "}"
    if all(not isinstance(v, (dict, list)) for v in x):  # scalars: as many a line as fit
        lines, line = [], []
        for item in (json.dumps(v, ensure_ascii=False) for v in x):
            if line and len(inner) + sum(len(i) + 2 for i in line) + len(item) + 1 > width:
                lines.append(", ".join(line))
                line = []
            line.append(item)
        lines.append(", ".join(line))
        return "[\n" + ",\n".join(inner + ln for ln in lines) + "\n" + pad + "]"
    return "[\n" + ",\n".join(inner + dumps(v, indent, width, _level + 1) for v in x) + "\n" + pad + "]"


def save_json(res: dict, out: str | Path | None, indent: int = 2) -> None:
    """The results as indented JSON at `out` (its folder made), when one is given, with what ran first:
    `bench.provenance`'s record (commit or tree hash, command, device, versions, date) under `provenance`.
    The one writer of raw results, so none goes without it."""
    if out:
        from bench.provenance import provenance
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        body = {"provenance": provenance(), **{k: v for k, v in res.items() if k != "provenance"}}
        Path(out).write_text(dumps(body, indent) + "\n")


def own_peak_rss_mib() -> float:
    """This process's peak resident memory in MiB since it started its program: Linux's VmHWM. (Not
    getrusage's ru_maxrss: a child started by fork or vfork counts the parent's resident pages from
    before its exec there, so a small stage run from a large parent would report the parent.)"""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    import resource  # elsewhere: the best available, with the caveat above (bytes on macOS, KiB on Linux)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2 ** 20 if sys.platform == "darwin" else 2 ** 10)
