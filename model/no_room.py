"""A write that failed for want of room (a full disk, a quota, `ulimit -f`), said in one line.

Torch-free, so a stage that writes only data (prepare) names a full disk the way the model writers
(model.model_dir.write_atomic) do without importing them.
"""
from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

# a write that failed for want of room: its errno, and what it means in words
NO_ROOM = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
           errno.EFBIG: "the file size limit of this process (`ulimit -f`) reached"}


class NoRoomError(OSError):
    """A file could not be written for want of room; the message is one line naming the file and the
    space left on its filesystem."""

    def __str__(self) -> str:
        return self.strerror  # the line itself, without OSError's "[Errno 28]"


def write_errno(e: BaseException | None) -> int | None:
    """The errno of a failed write: an OSError's own, or the one Rust's io::Error prints ("... (os error
    28)"), which safetensors and tokenizers raise as their own exception types. Looked for down the
    chain: torch.save's writer raises a RuntimeError of its own while the OSError is being handled."""
    while e is not None:
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found:
            return int(found.group(1))
        e = e.__cause__ or e.__context__
    return None


def no_room_errno(e: BaseException) -> int | None:
    """The errno of `e` (or what it was raised from) when a write failed for want of room (NO_ROOM), else None."""
    code = write_errno(e)
    return code if code in NO_ROOM else None


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def no_room_error(path: Path, code: int) -> NoRoomError:
    """The one-line error for a write of `path` that failed with errno `code` (a key of NO_ROOM)."""
    free = shutil.disk_usage(path.parent).free
    return NoRoomError(code, f"cannot write {path}: {NO_ROOM[code]}; {_size(free)} free on the filesystem "
                             f"holding {path.parent}")
