"""Carry a subset of a megablu dataset to the device in a call's 64 MiB: pack here, unpack there.

A device call carries at most 64 MiB. Token shards of code compress ~4.5x with xz (38 MB of
b3 -> 8.5 MB), so a dataset's needed buckets travel as one .tar.xz holding a *valid*
dataset: the chosen buckets' shards and a manifest listing only them (counts recomputed,
`subset` recording what was dropped). Every shard keeps its sha256, so `megablu data verify`
checks it after unpacking, and the loader verifies it again before training.

    python dev/carry_data.py pack data_cache/smol_corpus --buckets b3 --out data_cache/carry_a --name long
    python dev/carry_data.py unpack data_cache/carry_a --to data_cache/dev   # on the device
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import sys
import tarfile
from pathlib import Path


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 22), b""):
            h.update(b)
    return h.hexdigest()


def pruned_manifest(m: dict, buckets: list[str], splits: list[str]) -> dict:
    names = [b["name"] for b in m["buckets"]]
    bad = [b for b in buckets if b not in names]
    if bad:
        raise SystemExit(f"buckets {bad} not in the dataset (it has {names})")
    shards = [e for e in m["shards"] if e["bucket"] in buckets and e["split"] in splits]
    if not shards:
        raise SystemExit(f"no shards for buckets {buckets} splits {splits}")
    counts = {b: {s: c for s, c in m["counts"].get(b, {}).items() if s in splits} for b in buckets}
    out = dict(m, shards=shards, counts=counts)
    out["subset"] = {
        "buckets": buckets,
        "splits": splits,
        "of_shards": len(m["shards"]),
        "note": "a subset made by dev/carry_data.py; other buckets' shards are absent",
    }
    out.pop("histogram", None)  # of the whole set: would misdescribe the subset
    return out


def pack(src: Path, buckets: list[str], splits: list[str], out: Path, name: str) -> Path:
    m = json.loads((src / "manifest.json").read_text())
    pm = pruned_manifest(m, buckets, splits)
    out.mkdir(parents=True, exist_ok=True)
    dst = out / f"{name}.tar.xz"
    files = sorted({rel for e in pm["shards"] for rel in e["sha256"]})
    with lzma.open(dst, "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w") as t:
        blob = (json.dumps(pm, indent=1) + "\n").encode()
        info = tarfile.TarInfo(f"{name}/manifest.json")
        info.size = len(blob)
        t.addfile(info, io.BytesIO(blob))
        for rel in files:
            t.add(src / rel, arcname=f"{name}/{rel}")
    (out / f"{name}.sha256").write_text(f"{_sha(dst)}  {dst.name}\n")
    print(f"{dst}: {dst.stat().st_size / 2**20:.1f} MiB, {len(files)} files, buckets {buckets}, splits {splits}")
    return dst


def unpack(src: Path, to: Path) -> list[Path]:
    got = []
    to.mkdir(parents=True, exist_ok=True)
    for sums in sorted(src.glob("*.sha256")):
        want, fname = sums.read_text().split()
        arc = src / fname
        if _sha(arc) != want:
            raise SystemExit(f"{arc}: sha256 differs from {sums.name} (truncated carry?)")
        with tarfile.open(arc, "r:xz") as t:
            t.extractall(to, filter="data")
        got.append(to / fname[: -len(".tar.xz")])
        print(f"{arc} -> {got[-1]}")
    if not got:
        raise SystemExit(f"{src}: no *.sha256 / *.tar.xz to unpack")
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("src", type=Path)
    a.add_argument("--buckets", required=True, help="comma list, e.g. b0,b3")
    a.add_argument("--splits", default="train,val")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--name", required=True)
    u = sub.add_parser("unpack")
    u.add_argument("src", type=Path)
    u.add_argument("--to", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd == "pack":
        pack(args.src, args.buckets.split(","), args.splits.split(","), args.out, args.name)
    else:
        unpack(args.src, args.to)
    return 0


if __name__ == "__main__":
    sys.exit(main())
