"""Stage `prepare`: raw text and conversations -> parquet under artifacts/data (`sparkchat.paths`).

    pretrain/train_00000.parquet ... val_00000.parquet ...   column `text`: documents cut at paragraph
        ends, written as they arrive (a row group at a time), so memory stays flat in the corpus size;
        pretrain/index.json (shards, documents, characters, UTF-8 bytes) is written last
    mid_train.parquet / sft_train.parquet / chat_val.parquet   column `messages` (OpenAI-style, JSON)
    eval/<task>.jsonl    held-out eval items; no training item has the same prompt

The pretraining sources are read in order until the token budget is in (`data.pretrain_tokens`, or
derived from the model size: see `pretrain_token_budget`), so a hub source stops when the run has
enough; `data.max_docs_per_source` caps each source as well.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import random
import shutil
import sys
from pathlib import Path
from typing import Iterable, Iterator

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from model.no_room import NoRoomError, no_room_errno, no_room_error
from sparkchat import paths

from . import synthetic, tool_tasks
from .config import ConfigError, Params, load_params
from .metrics import write_json, write_reports
from .sources import SourceError, iter_conversations, iter_documents

CHUNK_CHARS = 4000
MAX_PARAGRAPH_CHARS = 1 << 20   # a longer paragraph (one huge line) is cut every this many characters
SHARD_CHARS = 128 << 20         # characters per parquet shard
ROW_GROUP_CHARS = 8 << 20       # characters per row group: what prepare holds, and what tokenize encodes at once
# before the tokenizer exists, the budget in tokens becomes characters at this rate (byte-level BPE on
# English prose gives about 3-5); the margin covers the guess and the validation share
ASSUMED_CHARS_PER_TOKEN = 4.0
BUDGET_MARGIN = 1.2


def iter_chunks(pieces: Iterable[str], size: int = CHUNK_CHARS, max_paragraph: int = MAX_PARAGRAPH_CHARS
                ) -> Iterator[str]:
    """Cut a document, given as pieces of any size, at blank lines into chunks of about `size`
    characters (whole paragraphs: the same cuts as on the whole text at once). A paragraph longer than
    `max_paragraph` is cut every `max_paragraph` characters, so memory stays bounded."""
    assert max_paragraph >= size

    def paragraphs() -> Iterator[str]:
        tail = ""
        for piece in pieces:
            tail += piece
            *done, tail = tail.split("\n\n")
            yield from done
            while len(tail) > max_paragraph:
                yield tail[:max_paragraph]
                tail = tail[max_paragraph:]
        yield tail

    cur, n = [], 0
    for para in paragraphs():
        cur.append(para)
        n += len(para) + 2
        if n >= size:
            chunk = "\n\n".join(cur).strip()
            cur, n = [], 0
            if chunk:
                yield chunk
    if cur and "\n\n".join(cur).strip():
        yield "\n\n".join(cur).strip()


def chunk_document(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Cut at blank lines into pieces of about `size` characters (whole paragraphs)."""
    return list(iter_chunks([text], size, max(size, MAX_PARAGRAPH_CHARS)))


def is_val(key: str, fraction: float, seed: int) -> bool:
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2 ** 64 < fraction


def _matmul_params(p: Params) -> int:
    """Parameters outside the embedding table, counted on a model built on the meta device (no memory)."""
    import torch
    from model.gpt import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig(**p.model.gpt_config(p.tokenizer.vocab_size)))
    return model.num_params() - model.wte.weight.numel()


def pretrain_token_budget(p: Params) -> int:
    """Tokens of pretraining text (train + val) prepare reads: `data.pretrain_tokens`, or else enough
    for what pretrain consumes (pretrain.steps x total_batch_tokens, else param_data_ratio x matmul
    params, as pipeline/train.py counts it), for the tokenizer's training text and for pretrain's
    validation (eval_tokens in the val share), x BUDGET_MARGIN."""
    if p.data.pretrain_tokens:
        return p.data.pretrain_tokens
    t, vf = p.pretrain, p.data.val_fraction
    train = t.steps * t.total_batch_tokens if t.steps else t.param_data_ratio * _matmul_params(p)
    train = max(train, p.tokenizer.train_chars / ASSUMED_CHARS_PER_TOKEN)
    return math.ceil(BUDGET_MARGIN * max(train / (1 - vf), t.eval_tokens / vf))


class ShardWriter:
    """Documents of one split -> parquet shards of about `shard_chars` characters, written a row group
    (about `group_chars` characters) at a time as documents arrive."""

    def __init__(self, folder: Path, split: str, shard_chars: int = SHARD_CHARS, group_chars: int = ROW_GROUP_CHARS):
        self.folder, self.split, self.shard_chars, self.group_chars = folder, split, shard_chars, group_chars
        self.shards: list[dict] = []
        self._writer: pq.ParquetWriter | None = None
        self._rows: list[str] = []
        self._row_chars = self._row_bytes = 0

    def add(self, text: str) -> None:
        self._rows.append(text)
        self._row_chars += len(text)
        self._row_bytes += len(text.encode("utf-8"))
        if self._row_chars >= self.group_chars:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        if self._writer is None:
            name = f"{self.split}_{len(self.shards):05d}.parquet"
            self._writer = pq.ParquetWriter(self.folder / name, pa.schema([("text", pa.string())]), compression="zstd")
            self.shards.append({"file": name, "docs": 0, "chars": 0, "bytes": 0})
        self._writer.write_table(pa.table({"text": self._rows}), row_group_size=len(self._rows))
        shard = self.shards[-1]
        shard["docs"] += len(self._rows)
        shard["chars"] += self._row_chars
        shard["bytes"] += self._row_bytes
        self._rows, self._row_chars, self._row_bytes = [], 0, 0
        if shard["chars"] >= self.shard_chars:
            self._writer.close()
            self._writer = None

    def close(self) -> dict:
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return {"shards": self.shards, **{k: sum(s[k] for s in self.shards) for k in ("docs", "chars", "bytes")}}


def prepare_pretrain(p: Params, folder: Path, shard_chars: int = SHARD_CHARS, group_chars: int = ROW_GROUP_CHARS) -> dict:
    """Stream the pretraining sources into train/val parquet shards until the token budget is in."""
    d = p.data
    folder.mkdir(parents=True, exist_ok=True)
    index = folder / "index.json"
    index.unlink(missing_ok=True)  # first: a killed run must not leave an index beside new shards
    for old in folder.glob("*.parquet"):
        old.unlink()
    budget_chars = pretrain_token_budget(p) * ASSUMED_CHARS_PER_TOKEN
    writers = {"train": ShardWriter(folder, "train", shard_chars, group_chars),
               "val": ShardWriter(folder, "val", shard_chars, group_chars)}
    chars, empty, read = 0, 0, {}
    # the bar's end: the budget, or the local sources' size on disk when that is smaller (an estimate:
    # JSON and parquet framing count too)
    local = [Path(s) for s in d.pretrain_sources if not s.startswith(("hub:", "builtin:"))]
    on_disk = sum(f.stat().st_size for q in local if q.exists() for f in ([q] if q.is_file() else q.rglob("*.txt")))
    total = min(budget_chars, on_disk) if len(local) == len(d.pretrain_sources) else budget_chars
    bar = tqdm(total=round(total), desc="prepare", unit="B", unit_scale=True, file=sys.stderr, mininterval=2.0)
    for src in d.pretrain_sources:
        read[src] = 0
        for doc in iter_documents(src, d.text_field, d.hub_split, d.max_docs_per_source):
            read[src] += 1
            pieces = 0
            for chunk in iter_chunks(doc):
                writers["val" if is_val(chunk, d.val_fraction, d.seed) else "train"].add(chunk)
                pieces += 1
                chars += len(chunk)
                bar.update(len(chunk))
                if chars >= budget_chars:
                    break
            empty += pieces == 0
            if chars >= budget_chars:
                break
        if chars >= budget_chars:
            break
    bar.close()
    splits = {name: w.close() for name, w in writers.items()}
    if not splits["train"]["docs"] or not splits["val"]["docs"]:
        raise SystemExit("prepare: the pretraining sources gave too little text for a train/val split "
                         f"({splits['train']['docs']} train, {splits['val']['docs']} val pieces)")
    info = {**splits, "empty_docs_skipped": empty, "docs_read": read, "budget_chars": round(budget_chars),
            "budget_reached": chars >= budget_chars}
    write_json(index, info)  # last: the shards are complete
    return info


def outputs(out: Path) -> list[Path]:
    """What prepare writes under `out` (the stage's outs in dvc.yaml, its report aside)."""
    return [out / f.relative_to(paths.DATA) for f in (paths.PRETRAIN_SHARDS, paths.MID_TRAIN, paths.SFT_TRAIN,
                                                       paths.CHAT_VAL, paths.EVAL_ITEMS)]


def prepare(p: Params, out: Path = paths.DATA, shard_chars: int = SHARD_CHARS, group_chars: int = ROW_GROUP_CHARS) -> dict:
    """Writes the data under `out`; returns what it read (the stage's details report). A write that fails
    for want of room (a full disk, a quota, `ulimit -f`: pyarrow's and datasets' writers raise the OSError)
    removes every output, so no partial data is left to hold the space, and raises NoRoomError."""
    try:
        return _prepare(p, out, shard_chars, group_chars)
    except Exception as e:
        code = no_room_errno(e)
        if code is None:
            raise
        error = no_room_error(out, code)  # the free space as the write found it, before the removal
        remove_outputs(out)
        raise error from None


def remove_outputs(out: Path) -> None:
    for f in outputs(out):
        if f.is_dir():
            shutil.rmtree(f)
        else:
            f.unlink(missing_ok=True)


def _prepare(p: Params, out: Path, shard_chars: int, group_chars: int) -> dict:
    d = p.data
    out.mkdir(parents=True, exist_ok=True)
    # -- pretraining text, streamed to shards (paths.PRETRAIN_SHARDS relative to `out`)
    pre = prepare_pretrain(p, out / paths.PRETRAIN_SHARDS.relative_to(paths.DATA), shard_chars, group_chars)

    # -- held-out eval items first, so training data can be filtered against them
    evals = synthetic.generate_eval(d.synthetic_eval, d.seed + 1)
    held_out = {synthetic.normalize_prompt(it["prompt"]) for items in evals.values() for it in items}
    # the tool-use task's held-out items: from a seed of their own, as the other tasks'
    evals["tool_use"] = tool_tasks.generate_eval(d.synthetic_eval, d.seed + 3)
    held_out_tools = {tool_tasks.key(it) for it in evals["tool_use"]}
    (out / "eval").mkdir(exist_ok=True)
    for task, items in evals.items():
        with open(out / "eval" / f"{task}.jsonl", "w") as f:
            for it in items:
                f.write(json.dumps(it) + "\n")

    # -- conversations (far smaller than the text: held in memory to be shuffled)
    convs: list[list[dict]] = []
    for src in d.chat_sources:
        if src == "builtin:synthetic":
            items = synthetic.dedupe_against(synthetic.generate_train(d.synthetic_train, d.seed), held_out)
            convs.extend(synthetic.conversations(items, d.synthetic_multi_turn, d.seed))
            tools = tool_tasks.generate(round(d.synthetic_train * d.tool_use_share), d.seed + 2)
            convs.extend(tool_tasks.conversation(it) for it in tools if tool_tasks.key(it) not in held_out_tools)
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
        # built in memory (a few MB), written by Python: pyarrow's parquet writer aborts the whole process
        # (a C++ check) when the disk fills under it, where Python's write raises ENOSPC, said in one line
        buf = io.BytesIO()
        datasets.Dataset.from_dict({"messages": [json.dumps(m) for m in rows]}).to_parquet(buf)
        (out / f"{name}.parquet").write_bytes(buf.getvalue())
    stats = {
        "pretrain_train_chars": pre["train"]["chars"], "pretrain_val_chars": pre["val"]["chars"],
        "pretrain_train_docs": pre["train"]["docs"], "pretrain_shards": len(pre["train"]["shards"]) + len(pre["val"]["shards"]),
        "pretrain_budget_reached": pre["budget_reached"], "empty_docs_skipped": pre["empty_docs_skipped"],
        "chat_train": len(train), "chat_val": len(val), "eval_items": {k: len(v) for k, v in evals.items()},
    }
    return stats


def main(argv=None) -> None:
    try:
        stats = prepare(load_params(stage="prepare"))
        write_reports("prepare", details=stats)  # counts of what it read: no headline metric
    except (ConfigError, SourceError) as e:
        raise SystemExit(f"prepare: {e}") from None
    except OSError as e:  # no room for the data (NoRoomError, its outputs removed) or for the report
        code = no_room_errno(e)
        if code is None:
            raise
        if not isinstance(e, NoRoomError):
            e = no_room_error(paths.details_file("prepare"), code)
            remove_outputs(paths.DATA)
        raise SystemExit(f"prepare: {e}. Free some space and run it again") from None
    print(f"prepare: {stats['pretrain_train_chars']:,} train chars in {stats['pretrain_train_docs']} pieces, "
          f"{stats['pretrain_val_chars']:,} val chars ({stats['pretrain_shards']} shards; token budget "
          f"{'reached' if stats['pretrain_budget_reached'] else 'not reached: the sources ran out'}; "
          f"{stats['empty_docs_skipped']} empty documents skipped); {stats['chat_train']:,} train / "
          f"{stats['chat_val']:,} val conversations; eval items {stats['eval_items']}", file=sys.stderr)


if __name__ == "__main__":
    main()
