"""Stage `prepare`: raw text and conversations -> parquet shards under artifacts/data.

    pretrain_train.parquet / pretrain_val.parquet   column `text` (documents cut at paragraph ends)
    mid_train.parquet / sft_train.parquet / chat_val.parquet   column `messages` (OpenAI-style, JSON)
    eval/<task>.jsonl    held-out eval items; no training item has the same prompt
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

import datasets

from . import synthetic
from sparkchat import paths

from .config import Params, load_params
from .metrics import write_json
from .sources import iter_conversations, iter_texts

CHUNK_CHARS = 4000


def chunk_document(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Cut at blank lines into pieces of about `size` characters (whole paragraphs)."""
    chunks, cur = [], []
    n = 0
    for para in text.split("\n\n"):
        cur.append(para)
        n += len(para) + 2
        if n >= size:
            chunks.append("\n\n".join(cur).strip())
            cur, n = [], 0
    if cur and "\n\n".join(cur).strip():
        chunks.append("\n\n".join(cur).strip())
    return chunks


def is_val(key: str, fraction: float, seed: int) -> bool:
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2 ** 64 < fraction


def prepare(p: Params, out: Path = paths.DATA, metrics: Path | None = None) -> dict:
    d = p.data
    out.mkdir(parents=True, exist_ok=True)
    # -- pretraining text
    train_text, val_text = [], []
    for src in d.pretrain_sources:
        for text in iter_texts(src, d.text_field, d.hub_split, d.max_docs_per_source):
            for chunk in chunk_document(text):
                (val_text if is_val(chunk, d.val_fraction, d.seed) else train_text).append(chunk)
    if not train_text or not val_text:
        raise SystemExit("prepare: the pretraining sources gave too little text for a train/val split")
    datasets.Dataset.from_dict({"text": train_text}).to_parquet(str(out / "pretrain_train.parquet"))
    datasets.Dataset.from_dict({"text": val_text}).to_parquet(str(out / "pretrain_val.parquet"))

    # -- held-out eval items first, so training data can be filtered against them
    evals = synthetic.generate_eval(d.synthetic_eval, d.seed + 1)
    held_out = {synthetic.normalize_prompt(it["prompt"]) for items in evals.values() for it in items}
    (out / "eval").mkdir(exist_ok=True)
    for task, items in evals.items():
        with open(out / "eval" / f"{task}.jsonl", "w") as f:
            for it in items:
                f.write(json.dumps(it) + "\n")

    # -- conversations
    convs: list[list[dict]] = []
    for src in d.chat_sources:
        if src == "builtin:synthetic":
            items = synthetic.dedupe_against(synthetic.generate_train(d.synthetic_train, d.seed), held_out)
            convs.extend(synthetic.to_messages(it) for it in items)
        else:
            for msgs in iter_conversations(src, d.hub_split, d.max_docs_per_source):
                first_user = next((m["content"] for m in msgs if m["role"] == "user"), "")
                if isinstance(first_user, str) and synthetic.normalize_prompt(first_user) in held_out:
                    continue
                convs.append(msgs)
    random.Random(d.seed).shuffle(convs)
    n_val = max(1, int(len(convs) * d.val_fraction))
    val, train = convs[:n_val], convs[n_val:]
    # midtraining sees all training conversations; SFT a fresh shuffle of them, padded and masked
    sft = list(train)
    random.Random(d.seed + 7).shuffle(sft)
    for name, rows in (("mid_train", train), ("sft_train", sft), ("chat_val", val)):
        datasets.Dataset.from_dict({"messages": [json.dumps(m) for m in rows]}).to_parquet(str(out / f"{name}.parquet"))
    stats = {
        "pretrain_train_chars": sum(map(len, train_text)), "pretrain_val_chars": sum(map(len, val_text)),
        "pretrain_train_docs": len(train_text), "chat_train": len(train), "chat_val": len(val),
        "eval_items": {k: len(v) for k, v in evals.items()},
    }
    write_json(metrics or out / "prepare.json", stats)
    return stats


def main(argv=None) -> None:
    p = load_params(stage="prepare")
    stats = prepare(p, metrics=paths.metrics_file("prepare"))
    print(f"prepare: {stats['pretrain_train_chars']:,} train chars in {stats['pretrain_train_docs']} pieces, "
          f"{stats['pretrain_val_chars']:,} val chars; {stats['chat_train']:,} train / {stats['chat_val']:,} "
          f"val conversations; eval items {stats['eval_items']}", file=sys.stderr)


if __name__ == "__main__":
    main()
