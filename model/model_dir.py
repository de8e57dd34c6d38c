"""The portable model directory: what the pipeline exports and the server (or any tool) loads.

    config.json        GPTConfig as JSON: the model is rebuilt from this alone
    model.safetensors  weights in float32, whatever precision backend trained them
    tokenizer.json     the `tokenizers` file with the chat special tokens
    generation.json    sampling defaults and whether the model was trained to call the calculator
    meta.json          (optional) the stage that trained it and its training metrics: steps, tokens, ...
    checksums.json     sha256 and size of each file above, written last: the directory's commit point

No DVC, no Transformer Engine and no training params are needed to load it. `load_model_dir` also takes a
Hugging Face transformers NanoChat directory (what `sparkchat export` writes, or a published NanoChat
checkpoint): its config.json names a `model_type`, and model/hf.py converts it (transformers is imported
only then).

Every file is written to a temporary name, fsynced and renamed, and checksums.json comes last, so a save
cut short by a crash or a power cut leaves a directory that fails its check rather than one that loads
half old, half new. Loading verifies each file against checksums.json and names the first one that is
missing, truncated or overwritten (`ModelDirError`). A sparkchat directory without checksums.json is
refused: nothing can tell its weights from damaged ones (4 KiB overwritten loads and answers garbage), so
it loads only when the user says they trust it (`TRUST_ENV`, named in the error). A transformers
directory from elsewhere carries no checksums by nature and loads with a warning. The pipeline's
checkpoints use the same helpers (`write_atomic`, `file_record`, `check_file`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from .gpt import GPT, GPTConfig
from .model_info import DEFAULT_GENERATION
from .no_room import NO_ROOM, NoRoomError, no_room_errno, no_room_error  # noqa: F401  (NO_ROOM, NoRoomError: importers')
from .tokenizer import SparkTokenizer

log = logging.getLogger(__name__)

CHECKSUMS = "checksums.json"
WEIGHTS = "model.safetensors"
REQUIRED = ("config.json", WEIGHTS, "tokenizer.json")
# a transformers directory may hold its weights in shards named by an index instead of model.safetensors
WEIGHTS_INDEX = "model.safetensors.index.json"
HF_REQUIRED = ("config.json", (WEIGHTS, WEIGHTS_INDEX), "tokenizer.json")
# set to 1 to load a sparkchat model directory that has no checksums.json (its files unverified)
TRUST_ENV = "SPARKCHAT_TRUST_UNVERIFIED_MODEL"


class ModelDirError(Exception):
    """A model directory that cannot be loaded; the message names the directory and the file."""


# ---- files written atomically, with a checksum to verify them by ----

def fsync_dir(path: Path) -> None:
    """Makes a rename inside `path` durable (POSIX: the directory entry is data too)."""
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temp_name(path: Path) -> Path:
    """Where write_atomic writes `path` before the rename (a crash may leave it behind)."""
    return path.with_name(path.name + ".tmp")


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` writes the file under a temporary name; it is fsynced, then renamed over `path`, so a
    crash leaves either the old file or the new one, each complete. A write that fails for want of room
    (a full disk, a quota, `ulimit -f`) removes the partial file and raises NoRoomError."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the bytes reach the disk before the name points at them
        finally:
            os.close(fd)
    except Exception as e:
        code = no_room_errno(e)
        if code is None:
            raise
        tmp.unlink(missing_ok=True)  # the partial file would only hold on to the space that ran out
        raise no_room_error(path, code) from None
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path) -> dict:
    """What `check_file` compares against later: the file's size and sha256."""
    return {"size": Path(path).stat().st_size, "sha256": sha256_file(path)}


def check_file(path: Path, record: dict) -> str | None:
    """None when `path` matches its record; otherwise what is wrong with it, in words."""
    path = Path(path)
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != record["size"]:
        what = "is empty" if size == 0 else f"has {size:,} bytes"
        return f"{what} where {record['size']:,} bytes were written (truncated, or a save cut short)"
    if sha256_file(path) != record["sha256"]:
        return "does not match the sha256 recorded when it was written (bytes overwritten, or a save cut short)"
    return None


# files this process has hashed, by what stat says of them: `sparkchat serve` checks a directory before its
# port opens and loads it after, and a d20 model's weights take seconds to hash
_verified: dict[tuple, str] = {}


def _stat_key(path: Path) -> tuple | None:
    """A file's identity and version: rewritten or replaced (a rename), it gets another key."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def verify_model_dir(path: str | Path) -> None:
    """Checks every file against checksums.json; raises ModelDirError naming the first bad one. Without
    checksums.json a sparkchat directory is refused unless `TRUST_ENV` is 1; a transformers directory
    (or a trusted one) has only its required files' presence checked, with a warning."""
    path = Path(path)
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist")
    manifest = path / CHECKSUMS
    if manifest.is_file():
        try:
            records = json.loads(manifest.read_text())
            files = {name: {"size": int(r["size"]), "sha256": str(r["sha256"])} for name, r in records.items()}
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ModelDirError(f"model directory {path} is damaged: {CHECKSUMS} cannot be read ({e})") from None
        for name, record in files.items():
            seen = _stat_key(path / name)
            if seen is not None and _verified.get(seen) == record["sha256"]:
                continue  # checked already by this process, and not touched since
            problem = check_file(path / name, record)
            if problem:
                raise ModelDirError(f"model directory {path} is damaged: {name} {problem}")
            _verified[seen] = record["sha256"]
    hf = is_hf_dir(path)
    for names in HF_REQUIRED if hf else REQUIRED:
        names = (names,) if isinstance(names, str) else names
        if not any((path / name).is_file() for name in names):
            kind = "complete Hugging Face model" if hf else "sparkchat model"
            raise ModelDirError(f"{path} is not a {kind} directory: {' or '.join(names)} is missing")
    if manifest.is_file():
        return
    if not hf and os.environ.get(TRUST_ENV) != "1":
        raise ModelDirError(
            f"model directory {path} has no {CHECKSUMS}, so its files cannot be verified: every sparkchat save "
            f"writes it last, so without it the save was cut short or the file was lost, and damaged weights would "
            f"load and answer garbage. If DVC made it, `dvc checkout --force {path}` restores it; if you trust these "
            f"files, set {TRUST_ENV}=1")
    log.warning("%s has no %s (%s): its files are loaded unverified", path, CHECKSUMS,
                "a transformers directory" if hf else f"trusted by {TRUST_ENV}=1")


def is_hf_dir(path: str | Path) -> bool:
    """A transformers directory: its config.json names a `model_type` (sparkchat's config.json does not)."""
    config = Path(path) / "config.json"
    try:
        return config.is_file() and "model_type" in json.loads(config.read_text())
    except ValueError:
        return False


def _json_writer(data) -> Callable[[Path], None]:
    return lambda p: p.write_text(json.dumps(data, indent=2) + "\n")


@contextlib.contextmanager
def _reading(path: Path, name: str):
    """Turns a failure to parse one file of the directory into a ModelDirError naming that file."""
    try:
        yield
    except Exception as e:
        raise ModelDirError(f"model directory {path}: {name} cannot be loaded ({type(e).__name__}: {e})") from e


def portable_state_dict(model: torch.nn.Module, sd: dict | None = None) -> dict[str, torch.Tensor]:
    """float32 copy of the weights under the plain GPT's names (backends may add extra state); `sd`: the
    model's state dict gathered elsewhere (a sharded model's, model/parallel.full_state_dict)."""
    sd = model.state_dict() if sd is None else sd
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("_orig_mod.").removeprefix("module.")
        if k.endswith("_extra_state") or not isinstance(v, torch.Tensor):
            continue
        out[k] = v.detach().to("cpu", torch.float32).contiguous()
    return out


def upgrade_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model directories written before q, k and v were fused hold `c_q`, `c_k`, `c_v`: join them."""
    for key in [k for k in sd if k.endswith("attn.c_q.weight")]:
        prefix = key.removesuffix("c_q.weight")
        sd[prefix + "c_qkv.weight"] = torch.cat([sd.pop(prefix + n + ".weight") for n in ("c_q", "c_k", "c_v")])
    return sd


def save_model_dir(path: str | Path, model: GPT, tokenizer: SparkTokenizer, generation: dict | None = None,
                   extra: dict | None = None, state_dict: dict | None = None) -> None:
    """`state_dict`: the weights when `model` does not hold them whole (FSDP: gathered by the caller)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    writers = {
        "config.json": _json_writer(model.config.to_dict()),
        "model.safetensors": lambda p: save_file(portable_state_dict(model, state_dict), str(p),
                                                 metadata={"format": "pt"}),
        "tokenizer.json": tokenizer.save,
        "generation.json": _json_writer({**DEFAULT_GENERATION, **(generation or {})}),
    }
    if extra:
        writers["meta.json"] = _json_writer(extra)
    for name, write in writers.items():
        write_atomic(path / name, write)
    # last: until this rename, a directory being overwritten fails its check against the old checksums
    write_atomic(path / CHECKSUMS, _json_writer({name: file_record(path / name) for name in writers}))


def build_model(config: GPTConfig, state_dict: dict[str, torch.Tensor], device, dtype) -> GPT:
    """A GPT in eval mode holding `state_dict` (sparkchat's names), built without a random init first."""
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    cos, sin = model._rope_tables(model.rope_len)
    model.cos, model.sin = cos.to(device), sin.to(device)
    model.load_state_dict(upgrade_state_dict(state_dict), strict=True)
    return model.to(dtype).eval()


def load_model_dir(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Returns (model in eval mode, tokenizer, generation defaults). Raises ModelDirError naming the file
    when the directory is damaged (see verify_model_dir) or a file cannot be parsed. (Its Linear weights in
    FP8, as a server may hold them: model.precision.fp8_weights.load_model_dir.)"""
    path = Path(path)
    verify_model_dir(path)
    if is_hf_dir(path):
        from .hf import load_hf_dir
        return load_hf_dir(path, device, dtype)
    with _reading(path, "config.json"):
        config = GPTConfig(**json.loads((path / "config.json").read_text()))
    with _reading(path, "model.safetensors"):
        model = build_model(config, load_file(str(path / "model.safetensors"), device=str(device)), device, dtype)
    gen = dict(DEFAULT_GENERATION)
    if (path / "generation.json").is_file():
        with _reading(path, "generation.json"):
            gen.update(json.loads((path / "generation.json").read_text()))
    with _reading(path, "tokenizer.json"):
        tok = SparkTokenizer.load(path / "tokenizer.json")
    return model, tok, gen
