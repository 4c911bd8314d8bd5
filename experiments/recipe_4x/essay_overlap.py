"""How much of the out-of-corpus loss text sits in the training corpus: the share of the essays' word 8-grams
(megablu:essays, the faithful suite's essay haystack and eval.loss.sets.essays) found in a dataset's TRAIN
split, and the documents holding them, by source. Run before the first training (README "Pre-run checks"):

    python experiments/recipe_4x/essay_overlap.py data_cache/r4x/corpus --tokenizer hf:data_cache/r4x/hf_tokenizer

Prints a markdown table; exit 0 always (a figure to report, not a gate).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import Counter
from pathlib import Path

ESSAYS = Path(__file__).resolve().parents[2] / "megablu" / "eval" / "assets" / "ruler" / "essays.txt.gz"


def grams(text: str, n: int = 8) -> set:
    w = re.findall(r"\w+", text.lower())
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def main(argv=None) -> int:
    from megablu.config.schema import TokenizerConfig
    from megablu.data.shards import DocTable, read_manifest
    from megablu.data.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="a megablu dataset dir (the training corpus)")
    ap.add_argument("--tokenizer", required=True, help="KIND:PATH of the dataset's tokenizer, e.g. hf:DIR")
    ap.add_argument("--split", default="train")
    a = ap.parse_args(argv)
    kind, path = a.tokenizer.split(":", 1)
    tok = load_tokenizer(TokenizerConfig(kind=kind, path=path))
    with gzip.open(ESSAYS, "rt", encoding="utf-8") as f:
        essay = grams(f.read())
    root = Path(a.data)
    m = read_manifest(root)
    seen, docs, total = set(), Counter(), Counter()
    for s in (x for x in m["shards"] if x["split"] == a.split):
        t = DocTable.open(root, [s], m["dtype"])
        metas = [json.loads(x) for x in (root / s["meta"]).read_text(encoding="utf-8").splitlines()]
        for i in range(len(t)):
            src = metas[i].get("source", "unknown")
            total[src] += 1
            hit = grams(tok.decode(t.doc(i).tolist())) & essay
            if hit:
                docs[src] += 1
                seen |= hit
    print(
        f"# essays' word 8-grams in {root} ({a.split}): {len(seen):,} of {len(essay):,} "
        f"({100 * len(seen) / max(1, len(essay)):.2f}%)\n"
    )
    print("| source | documents | holding an essay 8-gram |\n|---|---:|---:|")
    for src in sorted(total):
        print(f"| {src} | {total[src]:,} | {docs[src]:,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
