"""File helpers: checksums, fsync, atomic writes, and the rule for replacing an output (checkpoints,
datasets, exports and the hub use these)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Optional, Union

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


# --------------------------------------------------------------------------- where an output can go
# The longest file name most filesystems take (ext4, xfs, btrfs, tmpfs: NAME_MAX), in bytes; used where the
# filesystem cannot be asked (a folder not created yet).
NAME_MAX = 255
# bytes a temp name adds to an output's name: '.<name>.tmp-<pid>' / '.<name>.old-<pid>', pid <= 2**22 (Linux pid_max)
TEMP_NAME_EXTRA = len("..old-") + len(str(2**22))


def _exists(p: Path) -> bool:
    """p.exists(), False for any path the filesystem refuses to look up (a name too long, a loop)."""
    try:
        p.stat()
        return True
    except OSError:
        return False


def name_max(folder: PathLike) -> int:
    """NAME_MAX of the filesystem holding `folder` (its nearest existing ancestor), else NAME_MAX."""
    p = Path(folder)
    while not _exists(p) and p != p.parent:
        p = p.parent
    try:
        return int(os.pathconf(p, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return NAME_MAX


def _resolved(path: Path, flag: str) -> tuple[Optional[Path], Optional[str]]:
    """(the resolved path, None) or (None, why it cannot be resolved: a symlink loop)."""
    try:
        return path.resolve(), None
    except (OSError, RuntimeError) as e:  # ELOOP: RuntimeError before Python 3.13, OSError after
        return None, (
            f"{flag} {path} cannot be resolved ({getattr(e, 'strerror', None) or e}): a symlink loop "
            f"on its path? give {flag} another path"
        )


def writable_problem(target: PathLike, flag: str, given: Optional[PathLike] = None) -> Optional[str]:
    """Why this user cannot create files at `target` (a folder, made if absent), or None: a symlink loop on the
    path, a file where a folder must be, a place the filesystem refuses (a read-only mount, /proc, a folder
    without write permission). Probed by creating and removing an empty file in the nearest existing folder
    (permission bits do not stop root; a read-only mount or /proc stops everyone); nothing stays. `given`:
    what the user typed, when target is derived from it (the folder an output file goes into)."""
    import tempfile

    target = Path(target)
    derived = given is not None
    given = target if given is None else given
    res, why = _resolved(target, flag)
    if why or res is None:
        return why
    probe = res
    while not _exists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = "is a file" if probe == res and not derived else f"is under {probe}, which is a file"
        return f"{flag} {given} {where}, not a directory; give {flag} a path in a folder"
    try:
        fd, tmp = tempfile.mkstemp(prefix=".megablu-write-probe-", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return (
            f"{flag} {given}: cannot write there ({probe}: {e.strerror or e}); give {flag} a place this user can write"
        )
    return None


def new_name_problem(out: PathLike, flag: str, extra: int = 0) -> Optional[str]:
    """Why `out` cannot name a new entry of its folder, or None: '.', '..' or '/' (no name of its own), or a
    name longer than the filesystem takes once `extra` bytes are added (a temp name built from it)."""
    out = Path(out)
    if out.name in ("", ".", ".."):
        return (
            f"{flag} {out} names no new folder (it is {out.resolve()} itself); give {flag} a new name inside "
            f"it, e.g. {flag} {out / 'out'}"
        )
    n, top = len(os.fsencode(out.name)), name_max(out.parent)
    if n + extra > top:
        return (
            f"{flag} {out.name[:40]}...: the name is {n} bytes long, the filesystem takes {top} per name"
            + (f" ({extra} more are needed for the temp name it is written under)" if extra else "")
            + f"; give {flag} a name of at most {top - extra} bytes"
        )
    return None


def output_file_problem(path: PathLike, flag: str) -> Optional[str]:
    """Why a file cannot be written at `path` (written later, e.g. after a run), or None: checked first."""
    path = Path(path)
    why = new_name_problem(path, flag, extra=TEMP_NAME_EXTRA)
    if why is None and path.is_dir():
        why = f"{flag} {path} is a directory; give {flag} a file name"
    return why or writable_problem(path.parent, flag, path)


# --------------------------------------------------------------------------- replacing an output
def _overlap(a: Path, b: Path) -> bool:
    """a and b are the same path, or one lies inside the other (both resolved)."""
    return a == b or a in b.parents or b in a.parents


def replace_problem(
    out: PathLike,
    *,
    what: str,
    flag: str,
    replace: bool,
    owned: Callable[[Path], Optional[set[str]]],
    inputs: Iterable[PathLike] = (),
) -> Optional[str]:
    """Why a command that writes `what` may not write `out` (None: it may).

    The one rule for every destructive flag: megablu replaces only what it wrote itself. `owned(out)`
    recognises that (a manifest or marker it wrote) and returns every relative path it wrote there
    (folders included), or None when out is not such an output. `out` is never an input of the same
    command or inside one, nor holds one; a non-empty `out` is replaced only with `flag` (replace=True)
    and only when it holds nothing but what `owned` lists. Before any of that, `out` must be a place an
    output can go: a name of its own ('.' is not), no symlink loop, a name the filesystem takes, a folder
    beside it this user can write (new_name_problem, writable_problem). The message says what is in the way."""
    out = Path(out)
    ro, why = _resolved(out, "--out")
    if why or ro is None:
        return why
    why = new_name_problem(out, "--out", extra=TEMP_NAME_EXTRA) or _content_problem(
        out, ro, what=what, flag=flag, replace=replace, owned=owned, inputs=inputs
    )
    # last (it creates and removes a file): the new output is written beside `out` under a temp name and
    # renamed into place (swap_in), so the folder holding it must take files
    return why or writable_problem(ro.parent, "--out", out)


def _content_problem(
    out: Path,
    ro: Path,
    *,
    what: str,
    flag: str,
    replace: bool,
    owned: Callable[[Path], Optional[set[str]]],
    inputs: Iterable[PathLike],
) -> Optional[str]:
    """replace_problem's rule on what `out` is and holds (no filesystem writes)."""
    for i in inputs:
        ri = Path(i).resolve()
        if _overlap(ro, ri):
            rel = "is" if ro == ri else ("holds" if ro in ri.parents else "lies inside")
            return (
                f"{out} {rel} an input of this command ({i}); a command never writes over its own input: "
                f"give --out a new path outside it"
            )
    if not out.exists() and not out.is_symlink():
        return None
    if out.is_symlink() or not out.is_dir():
        return (
            f"{out} exists and is not a directory; megablu writes {what} only into a new or empty directory, "
            f"or with {flag} over {what} it wrote itself: give another --out"
        )
    entries = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    if not entries:
        return None
    mine = owned(out)
    if mine is None:
        top = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
        return (
            f"{out} exists and is not {what} (it holds {_few(top)}); {flag} replaces only {what} megablu "
            f"wrote, never another folder: give --out a new path"
        )
    foreign = [e for e in entries if e not in mine]
    if foreign:
        return (
            f"{out} is {what} megablu wrote, but it also holds {_few(foreign)}, which megablu did not write; "
            f"{flag} would delete them: move them out, or give --out a new path"
        )
    if not replace:
        return (
            f"{out} already holds {what}; pass {flag} to replace it (the old one is removed only once the new "
            f"one is complete)"
        )
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
