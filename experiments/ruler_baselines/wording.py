"""Does the question's wording explain the oracle's niah_single_3 disagreement? megablu's ruler_niah_* tasks
word a one-value question as RULER's niah.py does (lines 193-198: the whole template singular, "A special
magic uuid is hidden ... What is the special magic uuid for X ..."); lm-eval 0.4.13's RULER keeps the plural
template ("Some special magic uuids are hidden ... What are all the special magic uuids for X ...") and
only its answer prefix singular. This runs megablu's own task, same needles and haystack, both ways:

  python experiments/ruler_baselines/wording.py --config experiments/ruler_baselines/rep_smollm2_32k.yaml \\
      --ckpt /tmp/rl/smollm2_blu --set rope.yarn=null --set data.window=8192 --set train.device=cpu \\
      --set train.dtype=fp32 --lengths 4096 --n 50 ruler_niah_single_3

prints one line per wording and task: correct / n with its Wilson interval, and the paired difference.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def lm_eval_wording(full: str, type_needle_v: str) -> tuple[str, str]:
    """lm-eval's prepare_niah.py: the task text stays plural, the answer prefix reads singular."""
    from megablu.eval.ruler.templates import NIAH_ANSWER

    cut = full.rfind(NIAH_ANSWER[:10])
    answer = full[cut:].replace("{type_needle_v}", type_needle_v[:-1]).replace(" are", " is")
    return full[:cut] + answer, type_needle_v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tasks", nargs="+")
    ap.add_argument("--config", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--lengths", type=int, nargs="+", required=True)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")

    import ruler_oracle

    import megablu.eval.ruler.niah as niah
    from megablu.eval.lm_eval_adapter import load_for_eval
    from megablu.eval.stats import newcombe, wilson

    model, tok, cfg, _ = load_for_eval(args.config, args.ckpt, None, args.set, False)
    docs, _ = ruler_oracle.essay_docs(None)
    res = {}
    ruler_singular = niah.singular
    for name, fn in (("RULER (megablu)", ruler_singular), ("lm-eval", lm_eval_wording)):
        niah.singular = fn
        try:
            res[name] = ruler_oracle.run_megablu(model, tok, cfg, args.tasks, args.lengths, args.n, docs, 16384)
        finally:
            niah.singular = ruler_singular
    rows = []
    for (task, L), (k1, n1) in res["RULER (megablu)"].items():
        k2, n2 = res["lm-eval"][(task, L)]
        d = newcombe(k1, n1, k2, n2)
        rows.append(
            {
                "task": task,
                "length": L,
                "ruler": [k1, n1, *wilson(k1, n1)],
                "lm_eval_wording": [k2, n2, *wilson(k2, n2)],
                "diff": [d.diff, d.lo, d.hi],
            }
        )
        print(
            f"{task}@{L}: RULER wording {k1}/{n1} [{100 * wilson(k1, n1)[1]:.1f}, {100 * wilson(k1, n1)[2]:.1f}]"
            f"; lm-eval wording {k2}/{n2} [{100 * wilson(k2, n2)[1]:.1f}, {100 * wilson(k2, n2)[2]:.1f}]"
            f"; RULER - lm-eval {100 * d.diff:+.1f} pp [{100 * d.lo:+.1f}, {100 * d.hi:+.1f}] (unpaired)"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
