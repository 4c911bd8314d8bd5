"""Cells measured again after a fix, beside the first measurement, in one compare. For each result in --first,
a copy without the (task, length) cells and samples that a result of the same arm and step in --again holds,
written as --out/<its dir name>/step_<N>.json with a `cells_measured_again` record (which cells, and where
their new measurement lives); the result's derived `ruler` summary is dropped (compare recomputes it from
the cells). Then compare the copies with the again dirs:

  python experiments/ruler_baselines/rerun_join.py --first eval/rnative_4096 eval/rnative_8192 \\
      --again eval/rnative_fix_4096 eval/rnative_fix_8192 --out joined
  megablu compare joined/* eval/rnative_fix_* --md ruler.md

The first files are read, never written. A cell measured again must have been measured the first time
(else the again dir holds something new, not a re-measure: refused), and arms must match by name, step
and identity (weights, rope, tokenizer), as `megablu compare` joins them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def join(first: list[str], again: list[str], out: str) -> list[Path]:
    from megablu.eval.results import identity_differences, load_result

    news = [load_result(p) for p in again]
    olds = [load_result(p) for p in first]
    written = []
    claimed: set = set()  # (new result's path, task, length): cells that replace a first one
    for old in olds:
        mine = [
            n for n in news if (n["arm"], n["step"]) == (old["arm"], old["step"]) and not identity_differences(n, old)
        ]
        redo = {(c["task"], c["length"]): n["_path"] for n in mine for c in n["cells"]}
        again = [c for c in old["cells"] if (c["task"], c["length"]) in redo]
        claimed |= {(redo[(c["task"], c["length"])], c["task"], c["length"]) for c in again}
        res = {k: v for k, v in old.items() if k not in ("_path", "ruler")}
        res["cells"] = [c for c in old["cells"] if (c["task"], c["length"]) not in redo]
        res["samples"] = [s for s in old.get("samples", []) if (s["task"], s["length"]) not in redo]
        res["cells_measured_again"] = {
            "first": old["_path"],
            "cells": sorted(f"{c['task']}@{c['length']}" for c in again),
            "again_in": sorted({redo[(c["task"], c["length"])] for c in again}),
        }
        dest = Path(out) / Path(old["_path"]).parent.name / Path(old["_path"]).name
        if dest.resolve() == Path(old["_path"]).resolve():
            raise SystemExit(f"rerun_join: --out {out} would overwrite {old['_path']}; choose another folder")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(res, indent=1))
        written.append(dest)
    unmatched = sorted(
        f"{c['task']}@{c['length']} ({n['_path']})"
        for n in news
        for c in n["cells"]
        if (n["_path"], c["task"], c["length"]) not in claimed
    )
    if unmatched:
        raise SystemExit(
            f"rerun_join: measured again but not in any --first result of its arm: {', '.join(unmatched)} "
            f"(a first dir missing from --first, or another arm, step or model)"
        )
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--first", nargs="+", required=True, help="the first measurement's eval dirs or step files")
    ap.add_argument("--again", nargs="+", required=True, help="the cells measured again (their eval dirs)")
    ap.add_argument("--out", required=True, help="a folder for the first results less the cells measured again")
    args = ap.parse_args(argv)
    for p in join(args.first, args.again, args.out):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
