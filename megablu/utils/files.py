"""File helpers: checksums, fsync, atomic writes, and the rule for replacing an output (checkpoints,
datasets, exports and the hub use these)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

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


# --------------------------------------------------------------------------- replacing an output
def _overlap(a: Path, b: Path) -> bool:
    """a and b are the same path, or one lies inside the other (both resolved)."""
    return a == b or a in b.parents or b in a.parents


def replace_problem(out: PathLike, *, what: str, flag: str, replace: bool,
                    owned: Callable[[Path], Optional[set[str]]], inputs: Iterable[PathLike] = ()) -> Optional[str]:
    """Why a command that writes `what` may not write `out` (None: it may).

    The one rule for every destructive flag: megablu replaces only what it wrote itself. `owned(out)`
    recognises that (a manifest or marker it wrote) and returns every relative path it wrote there
    (folders included), or None when out is not such an output. `out` is never an input of the same
    command or inside one, nor holds one; a non-empty `out` is replaced only with `flag` (replace=True)
    and only when it holds nothing but what `owned` lists. The message says what is in the way."""
    out = Path(out)
    ro = out.resolve()
    for i in inputs:
        ri = Path(i).resolve()
        if _overlap(ro, ri):
            rel = "is" if ro == ri else ("holds" if ro in ri.parents else "lies inside")
            return (f"{out} {rel} an input of this command ({i}); a command never writes over its own input: "
                    f"give --out a new path outside it")
    if not out.exists() and not out.is_symlink():
        return None
    if out.is_symlink() or not out.is_dir():
        return (f"{out} exists and is not a directory; megablu writes {what} only into a new or empty directory, "
                f"or with {flag} over {what} it wrote itself: give another --out")
    entries = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    if not entries:
        return None
    mine = owned(out)
    if mine is None:
        top = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
        return (f"{out} exists and is not {what} (it holds {_few(top)}); {flag} replaces only {what} megablu "
                f"wrote, never another folder: give --out a new path")
    foreign = [e for e in entries if e not in mine]
    if foreign:
        return (f"{out} is {what} megablu wrote, but it also holds {_few(foreign)}, which megablu did not write; "
                f"{flag} would delete them: move them out, or give --out a new path")
    if not replace:
        return (f"{out} already holds {what}; pass {flag} to replace it (the old one is removed only once the new "
                f"one is complete)")
    return None


def _few(names: list[str], k: int = 5) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def swap_in(new: Path, out: Path) -> None:
    """Put the complete directory `new` at `out`: an existing `out` is renamed aside first and removed
    only once `new` is in place (a failure in between puts it back), so no failure loses both."""
    import shutil

    if not out.exists():
        os.replace(new, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
