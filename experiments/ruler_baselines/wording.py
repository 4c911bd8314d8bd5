"""Does the question's wording explain the oracle's niah_single_3 disagreement? megablu's ruler_niah_* tasks
word a one-value question as RULER's niah.py does (lines 193-198: the whole template singular, "A special
magic uuid is hidden ... What is the special magic uuid for X ..."); lm-eval 0.4.13's RULER keeps the plural
template ("Some special magic uuids are hidden ... What are all the special magic uuids for X ...") and
only its answer prefix singular. This runs megablu's own task, same needles and haystack, both ways:

  python experiments/ruler_baselines/wording.py --config experiments/ruler_baselines/rep_smollm2_32k.yaml \\
      --ckpt /tmp/rl/smollm2_blu --set rope.yarn=null --set data.window=8192 --set train.device=cpu \\
      --set train.dtype=fp32 --lengths 4096 --n 50 ruler_niah_single_3

prints one line per arm and task: correct / n with its Wilson interval. --arms lm_eval_like also starts the
essay haystack at the essays' first word, as RULER's niah.py and lm-eval do (megablu draws a window per prompt).
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


ARMS = {
    # name: (the question's wording, the essay haystack's start)
    "ruler": ("RULER", "drawn"),  # megablu's ruler_* task as it is
    "lm_eval_wording": ("lm-eval", "drawn"),
    "lm_eval_like": ("lm-eval", "start"),  # and the haystack from the essays' first word, as RULER's niah.py
}


class _Start:
    """An rng whose every offset is 0: the essay haystack from its start (RULER: haystack[:num_haystack])."""

    def randrange(self, n):
        return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tasks", nargs="+")
    ap.add_argument("--config", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--lengths", type=int, nargs="+", required=True)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--arms", nargs="+", default=["ruler", "lm_eval_wording"], choices=sorted(ARMS))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")

    import ruler_oracle

    import megablu.eval.ruler.niah as niah
    from megablu.eval.lm_eval_adapter import load_for_eval
    from megablu.eval.stats import wilson

    model, tok, cfg, _ = load_for_eval(args.config, args.ckpt, None, args.set, False)
    docs, _ = ruler_oracle.essay_docs(None)
    ruler_singular, ruler_rng = niah.singular, niah.RulerNiah.rng

    def start_rng(self, tag, *key):
        return _Start() if tag == "offset" else ruler_rng(self, tag, *key)

    rows = []
    for arm in args.arms:
        wording, start = ARMS[arm]
        niah.singular = lm_eval_wording if wording == "lm-eval" else ruler_singular
        niah.RulerNiah.rng = start_rng if start == "start" else ruler_rng
        try:
            res = ruler_oracle.run_megablu(model, tok, cfg, args.tasks, args.lengths, args.n, docs, 16384)
        finally:
            niah.singular, niah.RulerNiah.rng = ruler_singular, ruler_rng
        for (task, L), (k, n) in res.items():
            _, lo, hi = wilson(k, n)
            rows.append({"arm": arm, "wording": wording, "haystack": start, "task": task, "length": L, "k": k, "n": n})
            print(f"{task}@{L} {arm} ({wording} wording, haystack {start}): {k}/{n} [{100 * lo:.1f}, {100 * hi:.1f}]")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
