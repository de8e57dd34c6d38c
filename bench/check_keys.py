"""Does a benchmark's raw JSON carry the figures a claim rests on? `python -m bench.check_keys FILE [KEY...]`

Looks for each key anywhere in the file (at any depth) and fails, naming every key that is missing or
has a value that is not a figure: a number, or {median, min, max} of numbers (bench/stats.py's spread);
with `per_variant`, also a mapping of figures (one per precision, say); `commit` and `date` must be
non-empty strings. Every value stored under a key must pass, not just one. Without KEYs, the keys issue
55's closing note quotes (`SERVING_KEYS`), which `python -m bench.serve_client --peer` on a GPU writes.
The one checker of raw JSON: `python -m bench.vs_nanochat check` calls `check_files` over several files.
"""
from __future__ import annotations

import json
import sys
from numbers import Real
from pathlib import Path

SERVING_KEYS = ("floor_fraction", "tokens_per_s_128", "of_engine_64", "of_engine_128", "over_transformers",
                "commit", "date")
TEXT_KEYS = ("commit", "date")


def find(data, key: str) -> list:
    """Every value stored under `key` anywhere in `data`, save_json's `provenance` record aside (what
    ran, not a claim: its `commit` is None for a tree with changes, which its `tree_hash` names)."""
    found = []
    if isinstance(data, dict):
        for k, v in data.items():
            if k == "provenance":
                continue
            if k == key:
                found.append(v)
            found += find(v, key)
    elif isinstance(data, list):
        for v in data:
            found += find(v, key)
    return found


def _number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def is_figure(v, per_variant: bool = False) -> bool:
    """A number or a {median, min, max} spread; with `per_variant`, also a non-empty mapping of figures."""
    if _number(v) or (isinstance(v, dict) and all(_number(v.get(k)) for k in ("median", "min", "max"))):
        return True
    return per_variant and isinstance(v, dict) and bool(v) and all(is_figure(x, True) for x in v.values())


def problems(data, keys, per_variant: bool = False) -> list[str]:
    """One line for each key that is missing or has a value that is not a figure (empty: all there).
    `data` may be a list of documents (several runs' files): a key must be in one of them at least."""
    out = []
    for key in keys:
        values = find(data, key)
        if not values:
            out.append(f"{key}: missing")
        elif key in TEXT_KEYS:
            if bad := [v for v in values if not (isinstance(v, str) and v)]:
                out.append(f"{key}: not a non-empty string ({bad[0]!r})")
        elif bad := [v for v in values if not is_figure(v, per_variant)]:
            out.append(f"{key}: not a number or {{median, min, max}} ({bad[0]!r})")
    return out


def check_files(paths: list[str], keys, per_variant: bool = False) -> int:
    """`problems` over the files together, each on stderr (or one line saying all is there): 0 or 1."""
    data = []
    for path in paths:
        try:
            data.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            print(f"{path}: cannot be read as JSON ({e})", file=sys.stderr)
            return 1
    name = ", ".join(paths)
    bad = problems(data, keys, per_variant)
    for line in bad:
        print(f"{name}: {line}", file=sys.stderr)
    if not bad:
        print(f"{name}: {', '.join(keys)}: all there")
    return 1 if bad else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__.split("\n")[0], file=sys.stderr)
        return 2
    return check_files(argv[:1], argv[1:] or list(SERVING_KEYS))


if __name__ == "__main__":
    sys.exit(main())
