"""Does a benchmark's raw JSON carry the figures a claim rests on? `python -m bench.check_keys FILE [KEY...]`

Looks for each key anywhere in the file (at any depth) and fails, naming every key that is missing or
whose value is not a figure: a number, or {median, min, max} of numbers (bench/stats.py's spread);
`commit` and `date` must be non-empty strings. Without KEYs, the keys issue 55's closing note quotes
(`SERVING_KEYS`), which `python -m bench.serve_client --peer` on a GPU writes.
"""
from __future__ import annotations

import json
import sys
from numbers import Real

SERVING_KEYS = ("floor_fraction", "tokens_per_s_128", "of_engine_64", "of_engine_128", "over_transformers",
                "commit", "date")
TEXT_KEYS = ("commit", "date")


def find(data, key: str) -> list:
    """Every value stored under `key` anywhere in `data`."""
    found = []
    if isinstance(data, dict):
        for k, v in data.items():
            if k == key:
                found.append(v)
            found += find(v, key)
    elif isinstance(data, list):
        for v in data:
            found += find(v, key)
    return found


def is_figure(v) -> bool:
    number = lambda x: isinstance(x, Real) and not isinstance(x, bool)  # noqa: E731
    return number(v) or (isinstance(v, dict) and all(number(v.get(k)) for k in ("median", "min", "max")))


def problems(data, keys) -> list[str]:
    """One line for each key that is missing or not a figure (empty: all there)."""
    out = []
    for key in keys:
        values = find(data, key)
        if not values:
            out.append(f"{key}: missing")
        elif key in TEXT_KEYS:
            if not any(isinstance(v, str) and v for v in values):
                out.append(f"{key}: not a non-empty string ({values[0]!r})")
        elif not any(is_figure(v) for v in values):
            out.append(f"{key}: not a number or {{median, min, max}} ({values[0]!r})")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__.split("\n")[0], file=sys.stderr)
        return 2
    path, keys = argv[0], argv[1:] or list(SERVING_KEYS)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        print(f"{path}: cannot be read as JSON ({e})", file=sys.stderr)
        return 1
    bad = problems(data, keys)
    for line in bad:
        print(f"{path}: {line}", file=sys.stderr)
    if not bad:
        print(f"{path}: {', '.join(keys)}: all there")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
