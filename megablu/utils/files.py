"""File helpers: checksums, fsync, atomic writes (checkpoints, datasets and the hub use these)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Union

PathLike = Union[str, Path]


def sha256_file(path: PathLike, bufsize: int = 1 << 23) -> str:
    """Hex sha256 of a file's bytes, read in `bufsize` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(bufsize)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def fsync_file(path: PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: PathLike) -> None:
    try:
        fsync_file(path)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass


def atomic_write_text(path: Path, text: str) -> None:
    """Write a temp file beside `path`, fsync it, rename it over `path`, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
