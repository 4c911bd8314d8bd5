"""Where does the oracle's essay-task gap come from? megablu's ruler_niah_* tasks and lm-eval 0.4.13's RULER
word their prompts alike (RULER's singular rewrite for one asked value, the same answer prefix up to its
leading space, which lm-eval strips under a chat template and RULER keeps) but build the essay haystack
differently: megablu draws a window of the essays per prompt (a second eval.seed is a second
sample) and fills the prompt to exactly L tokens; RULER's niah.py and lm-eval take the essays from their first
word every time (haystack[:num_haystack]) and grow the haystack in steps of words, so their prompts end up
shorter than L (3,650 of 4,096 at niah_single_2 with SmolLM2's tokenizer). This runs megablu's own task with
the haystack drawn (arm ruler) or from the start (arm start), and each with lm-eval's answer prefix (arms
nospace, start_nospace), at any length:

  python experiments/ruler_baselines/essay_gap.py --config experiments/ruler_baselines/rep_smollm2_32k.yaml \
      --ckpt /tmp/rl/smollm2_blu --set rope.yarn=null --set data.window=8192 --set train.device=cpu \
      --set train.dtype=fp32 --set "eval.lengths=[3712]" --set "eval.tasks=[ruler_niah_single_3]" \
      --lengths 3712 --n 50 --arms start ruler_niah_single_3

prints one line per arm, task and length: correct / n with its Wilson interval.
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


ARMS = {
    # name: (the essay haystack's start, the answer prefix after the chat template's assistant turn)
    "ruler": ("drawn", "ruler"),  # megablu's ruler_* task as it is: a window per prompt, RULER's prefix
    "start": ("start", "ruler"),  # from the essays' first word in every prompt, as RULER's niah.py and lm-eval
    # lm-eval's gen_prefix: RULER's answer prefix stripped of its leading space (" The special magic ..."
    # follows "assistant\n" in RULER's input + answer_prefix; lm-eval renders "The special magic ...")
    "nospace": ("drawn", "lm-eval"),
    "start_nospace": ("start", "lm-eval"),
}


def patched(arm: str):
    """megablu's RULER tasks built as `arm` says (ARMS) while the block runs (ruler_oracle.lm_eval_layout)."""
    import ruler_oracle

    start, prefix = ARMS[arm]
    return ruler_oracle.lm_eval_layout(haystack=start == "start", prefix=prefix == "lm-eval")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tasks", nargs="+")
    ap.add_argument("--config", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--lengths", type=int, nargs="+", required=True)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--arms", nargs="+", default=["ruler", "start"], choices=sorted(ARMS))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")

    import ruler_oracle

    from megablu.eval.lm_eval_adapter import load_for_eval
    from megablu.eval.stats import wilson

    model, tok, cfg, _ = load_for_eval(args.config, args.ckpt, None, args.set, False)
    docs, _ = ruler_oracle.essay_docs(None)
    rows = []
    for arm in args.arms:
        start, prefix = ARMS[arm]
        with patched(arm):
            res = ruler_oracle.run_megablu(model, tok, cfg, args.tasks, args.lengths, args.n, docs, 16384)
        for (task, L), (k, n) in res.items():
            _, lo, hi = wilson(k, n)
            rows.append({"arm": arm, "haystack": start, "prefix": prefix, "task": task, "length": L, "k": k, "n": n})
            print(
                f"{task}@{L} {arm} (essay haystack {start}, {prefix} answer prefix): {k}/{n} "
                f"[{100 * lo:.1f}, {100 * hi:.1f}]"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
