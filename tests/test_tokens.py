"""The data path at scale, on small real inputs: prepare streams a generated corpus into shards, the
tokenize stage writes token files (deterministic, index last, refused when incomplete), and the
loaders read memory-mapped tokens (disjoint across ranks, resumable)."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import socket
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from bench.corpus import write_corpus
from model.tokenizer import SparkTokenizer
from pipeline.config import params_from_dict
from pipeline.data import ChatBatches, DataError, TokenStream, open_tokens, shard_texts
from pipeline.prepare import chunk_document, iter_chunks, prepare, pretrain_token_budget
from pipeline.sources import SourceError, iter_documents, iter_texts, read_text_blocks
from pipeline import sources
from pipeline.tokenize import render_conversation, tokenize_all
from sparkchat import paths


def small_params(corpus: Path, **data) -> object:
    return params_from_dict({"data": {"pretrain_sources": [str(corpus)], "chat_sources": ["builtin:synthetic"],
                                      "synthetic_train": 300, "synthetic_eval": 5, "val_fraction": 0.1,
                                      "pretrain_tokens": 10 ** 9, **data}})


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A generated corpus through prepare (small shards and row groups) and a tokenizer trained on it."""
    root = tmp_path_factory.mktemp("proj")
    corpus = root / "corpus.parquet"
    write_corpus(1_500_000, corpus, seed=3, progress=False)
    p = small_params(corpus)
    stats = prepare(p, root / paths.DATA, shard_chars=300_000, group_chars=60_000)
    tok = SparkTokenizer.train(shard_texts(root / paths.PRETRAIN_SHARDS, "train"), 400)
    return root, corpus, p, stats, tok


def test_prepare_streams_into_bounded_shards(project):
    root, corpus, p, stats, _ = project
    folder = root / paths.PRETRAIN_SHARDS
    index = json.loads((folder / "index.json").read_text())
    assert len(index["train"]["shards"]) >= 3, "expected several shards"
    for split in ("train", "val"):
        for shard in index[split]["shards"]:
            pf = pq.ParquetFile(folder / shard["file"])
            assert pf.metadata.num_rows == shard["docs"]
            for g in range(pf.metadata.num_row_groups):  # written a row group at a time: ~60k chars + a piece
                assert sum(map(len, pf.read_row_group(g).column("text").to_pylist())) < 60_000 + 20_000
    # every piece of the corpus, in order, split between train and val
    want = [c for doc in iter_texts(str(corpus)) for c in chunk_document(doc)]
    got_train, got_val = list(shard_texts(folder, "train")), list(shard_texts(folder, "val"))
    assert sorted(got_train + got_val) == sorted(want)
    assert got_train == [c for c in want if c in set(got_train)]
    assert stats["pretrain_train_docs"] == len(got_train) and not stats["pretrain_budget_reached"]


def test_prepare_is_deterministic(project, tmp_path):
    root, _, p, _, _ = project
    prepare(p, tmp_path / "data", shard_chars=300_000, group_chars=60_000)
    first, again = root / paths.PRETRAIN_SHARDS, tmp_path / "data" / paths.PRETRAIN_SHARDS.relative_to(paths.DATA)
    names = sorted(f.name for f in first.iterdir())
    assert names == sorted(f.name for f in again.iterdir()) and len(names) > 3
    for name in names:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name


def test_prepare_stops_at_the_token_budget(tmp_path, project):
    corpus = project[1]
    p = small_params(corpus, pretrain_tokens=50_000)
    stats = prepare(p, tmp_path / "data")
    chars = stats["pretrain_train_chars"] + stats["pretrain_val_chars"]
    assert stats["pretrain_budget_reached"] and 200_000 <= chars < 200_000 + 5_000  # 4 chars a token
    # derived when 0: steps x batch over the train share, at least the tokenizer's text and the val
    # tokens in the val share, x margin
    derived = {"pretrain": {"steps": 10, "total_batch_tokens": 1000, "eval_tokens": 100}, "data": {"val_fraction": 0.1},
               "tokenizer": {"train_chars": 400}}
    assert pretrain_token_budget(params_from_dict(derived)) == math.ceil(1.2 * 10_000 / 0.9)
    derived["tokenizer"]["train_chars"] = 400_000  # 100k tokens at 4 characters a token
    assert pretrain_token_budget(params_from_dict(derived)) == math.ceil(1.2 * 100_000 / 0.9)
    derived["pretrain"]["eval_tokens"] = 20_000
    assert pretrain_token_budget(params_from_dict(derived)) == math.ceil(1.2 * 20_000 / 0.1)


def test_tokenize_matches_the_renderer_and_is_deterministic(project, tmp_path):
    root, _, _, _, tok = project
    tokenize_all(tok, root)
    text = open_tokens(root / paths.PRETRAIN_TRAIN_TOKENS, tok)
    assert text.ids.dtype == np.uint16
    want = [i for doc in shard_texts(root / paths.PRETRAIN_SHARDS, "train") for i in [tok.bos_id] + tok.encode(doc)]
    assert text.ids.tolist() == want
    chat = open_tokens(root / paths.SFT_TRAIN_TOKENS, tok)
    convs = [json.loads(m) for m in pq.read_table(root / paths.SFT_TRAIN).column("messages").to_pylist()]
    for i in (0, 1, len(convs) - 1):
        ids, mask = render_conversation(tok, convs[i])
        s, e = chat.offsets[i], chat.offsets[i + 1]
        assert chat.ids[s:e].tolist() == ids and chat.mask[s:e].tolist() == mask

    def digest(folder: Path) -> dict:
        return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.rglob("*")) if f.is_file()}

    first = digest(root / paths.TOKENS)
    tokenize_all(tok, root)
    assert digest(root / paths.TOKENS) == first and len(first) == 3 + 1 + 3 * 3


def test_conversations_render_alike_in_worker_processes(project, tmp_path, monkeypatch):
    root, _, _, _, tok = project
    from pipeline import tokenize
    sources = {"sft_train": root / paths.SFT_TRAIN}
    tokenize.tokenize_conversations(tok, sources, tmp_path / "one")
    monkeypatch.setattr(tokenize, "POOL_MIN_CONVERSATIONS", 0)
    monkeypatch.setattr(tokenize, "CONVERSATIONS_PER_TASK", 16)  # many tasks, in flight at once
    tokenize.tokenize_conversations(tok, sources, tmp_path / "pool")
    for name in ("sft_train.ids.bin", "sft_train.mask.bin", "sft_train.offsets.bin", "index.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "pool" / name).read_bytes(), name


def test_a_failed_tokenize_leaves_no_index(project, tmp_path):
    """A stage that dies mid-way (here: a damaged second shard) leaves token files that nothing reads."""
    root, _, _, _, tok = project
    shutil.copytree(root / paths.DATA, tmp_path / paths.DATA)
    shards = tmp_path / paths.PRETRAIN_SHARDS
    index = json.loads((shards / "index.json").read_text())
    second = shards / index["train"]["shards"][1]["file"]
    second.write_bytes(second.read_bytes()[: second.stat().st_size // 2])
    tokenize_all(tok, root)  # a complete earlier run's files in place...
    shutil.copytree(root / paths.TOKENS, tmp_path / paths.TOKENS)
    with pytest.raises((OSError, pa.ArrowException)):
        tokenize_all(tok, tmp_path)
    assert not (tmp_path / paths.token_index(paths.PRETRAIN_TRAIN_TOKENS)).exists()  # ...no longer pass
    assert (tmp_path / paths.PRETRAIN_TOKENS / "train.ids.bin").exists()
    with pytest.raises(DataError, match="run the tokenize stage"):
        open_tokens(tmp_path / paths.PRETRAIN_TRAIN_TOKENS, tok)


def test_disk_full_while_tokenizing(project, tmp_path):
    root, _, _, _, tok = project
    shutil.copytree(root / paths.DATA, tmp_path / paths.DATA)
    out = tmp_path / paths.PRETRAIN_TOKENS
    out.mkdir(parents=True)
    (out / "train.ids.bin").symlink_to("/dev/full")  # the kernel answers every write with ENOSPC
    from pipeline.tokenize import TokenizeError
    with pytest.raises(TokenizeError, match="disk full.*No index was written"):
        tokenize_all(tok, tmp_path)
    assert not (out / "index.json").exists()


def test_reader_refuses_mismatched_files(project, tmp_path):
    root, _, _, _, tok = project
    tokenize_all(tok, root)
    shutil.copytree(root / paths.TOKENS, tmp_path / paths.TOKENS)
    split = tmp_path / paths.PRETRAIN_VAL_TOKENS
    other = SparkTokenizer.train(["a b c d e f g"] * 10, 320)
    with pytest.raises(DataError, match="another tokenizer"):
        open_tokens(split, other)
    with open(tmp_path / paths.PRETRAIN_TOKENS / "val.ids.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="does not match its index"):
        open_tokens(split, tok)


# -- loaders ---------------------------------------------------------------------------------------

def test_token_stream_state_round_trip():
    tokens = np.arange(10_000, dtype=np.uint32)
    a = TokenStream(tokens, 4, 16)
    for _ in range(200):  # past the end of an epoch: 156 micro-steps each
        a.next()
    b = TokenStream(tokens, 4, 16)
    b.load_state(a.state())
    assert a.state()["epoch"] == 1
    for _ in range(5):
        (xa, ya), (xb, yb) = a.next(), b.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and torch.equal(xa[:, 1:], ya[:, :-1])
        assert xa.dtype == torch.long


def _rank_reads(rank: int, world: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tokens = np.memmap(path, dtype=np.uint32, mode="r")
    stream = TokenStream(tokens, 2, 8, rank, world)
    seen = [stream.next()[0].flatten().tolist() for _ in range(20)]  # past an epoch (12 micro-steps)
    gathered = [None] * world
    dist.all_gather_object(gathered, seen)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def test_ranks_read_disjoint_tokens(tmp_path):
    path = tmp_path / "ids.bin"
    np.arange(400, dtype=np.uint32).tofile(path)  # every token value is its position
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(_rank_reads, args=(2, port, str(path), str(tmp_path / "seen.json")), nprocs=2,
                       start_method="spawn")
    r0, r1 = json.loads((tmp_path / "seen.json").read_text())
    epoch = 12  # (400 - 1) // (2 * 8 * 2) micro-steps per epoch
    first0 = {t for b in r0[:epoch] for t in b}
    first1 = {t for b in r1[:epoch] for t in b}
    assert not first0 & first1
    assert first0 | first1 == set(range(epoch * 2 * 16))  # together, every token of the epoch once
    assert r0[epoch] == r0[0] and r1[epoch] == r1[0]  # the next epoch starts over


def test_chat_batches_learn_only_the_assistant(project):
    root, _, _, _, tok = project
    tokenize_all(tok, root)
    split = open_tokens(root / paths.SFT_TRAIN_TOKENS, tok)
    batches = ChatBatches(split, tok.special["<|assistant_end|>"], 4, 64, False, seed=1)
    x, y = batches.next()
    order = batches._shuffled(0)[:4]
    for r, row in enumerate(order):
        s, n = batches.rows[row]
        ids, mask = split.ids[s:s + n].tolist(), split.mask[s:s + n].tolist()
        assert x[r, :n - 1].tolist() == ids[:-1]
        assert y[r, :n - 1].tolist() == [t if m else -1 for t, m in zip(ids[1:], mask[1:])]
        assert (y[r, n - 1:] == -1).all()


# -- bad input -------------------------------------------------------------------------------------

def test_empty_documents_are_skipped_and_counted(tmp_path):
    rows = [{"text": f"real words, number {i}. " * 50} for i in range(20)]
    rows[3:3] = [{"text": ""}, {"text": "   \n\n  "}, {"text": None}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    p = small_params(tmp_path / "c.jsonl", val_fraction=0.4)
    stats = prepare(p, tmp_path / "data")
    assert stats["empty_docs_skipped"] == 3


def test_invalid_utf8_names_file_and_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes("é".encode() * 1500 + b"ok \xff more")  # the bad byte at 3003, blocks of 1024
    with pytest.raises(SourceError, match=r"bad\.txt: invalid UTF-8 at byte offset 3003"):
        list(read_text_blocks(path, block=1024))
    # characters cut by a block boundary are not errors
    good = tmp_path / "good.txt"
    good.write_text("é€🙂" * 5000, encoding="utf-8")
    assert "".join(read_text_blocks(good, block=1000)) == "é€🙂" * 5000


def test_a_huge_line_never_sits_in_memory(tmp_path):
    path = tmp_path / "line.txt"
    line = ("word " * 1_000_000 * 4)[:16_000_000]  # 16 MB without a paragraph break
    path.write_text(line)
    del line
    tracemalloc.start()
    total, longest = 0, 0
    for chunk in iter_chunks(read_text_blocks(path, block=256 << 10), max_paragraph=1 << 20):
        total += len(chunk) + 2
        longest = max(longest, len(chunk))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert longest <= 1 << 20 and total >= 15_900_000
    assert peak < 8 << 20, f"peak {peak:,} bytes for a 16 MB line"


def test_missing_column_and_oversized_json_line(tmp_path, monkeypatch):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(SourceError, match=r"t\.parquet' has no column 'text' \(columns: body\)"):
        list(iter_documents(str(tmp_path / "t.parquet")))
    monkeypatch.setattr(sources, "MAX_JSON_LINE", 1000)
    (tmp_path / "big.jsonl").write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": "b" * 2000}) + "\n")
    with pytest.raises(SourceError, match=r"big\.jsonl: line 2 is longer than"):
        list(iter_documents(str(tmp_path / "big.jsonl")))
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "a"}\n{"text": \xff}\n')
    with pytest.raises(SourceError, match=r"bad\.jsonl: line 2 is not a valid JSON"):
        list(iter_documents(str(tmp_path / "bad.jsonl")))
