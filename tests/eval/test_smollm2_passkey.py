"""Real check (opt-in, slow): SmolLM2-135M through from_hf and the harness, passkey on CPU.

Expected (DESIGN.md): passes at ~4.6k tokens (inside its 8192 training length), fails at
~13.8k without YaRN, passes at ~13.8k with YaRN factor 2 (no fine-tuning). Run with
    MEGABLU_SLOW=1 .venv/bin/pytest tests/eval/test_smollm2_passkey.py -s
MEGABLU_SMOLLM2_N (default 3) prompts per length; MEGABLU_EVAL_OUT keeps the result JSONs.
Measured numbers are recorded in experiments/ruler_baselines/LOG.md. With n this small the assertions are
majority votes (>= 60% / <= 40%), not resolved differences; RESULTS.md gives the intervals.
"""

import os
import tempfile
from pathlib import Path

import pytest
import torch

from . import _smollm2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("MEGABLU_SLOW") != "1",
        reason="slow real-model check (~30 min on 2 CPU cores); set MEGABLU_SLOW=1 to run",
    ),
    pytest.mark.skipif(
        not _smollm2.available(),
        reason=f"SmolLM2 GGUF not at {_smollm2.GGUF_DIR / _smollm2.GGUF} (see tests/eval/_smollm2.py)",
    ),
]

LENGTHS = [4584, 13800]  # + max_new 24 = 4608 and 13824, multiples of 256 inside a 16384 window


def test_smollm2_passkey_yarn():
    from megablu.config.schema import EvalConfig
    from megablu.eval.harness import run_eval
    from megablu.eval.report import markdown

    torch.set_num_threads(int(os.environ.get("MEGABLU_THREADS", "2")))
    n = int(os.environ.get("MEGABLU_SMOLLM2_N", "3"))
    tok = _smollm2.load_tokenizer()
    base, yarn = _smollm2.load_models(2.0)
    cfg = EvalConfig(lengths=LENGTHS, tasks=["passkey"], n=n, max_new=24, pad=256, seed=0)
    out = Path(os.environ.get("MEGABLU_EVAL_OUT") or tempfile.mkdtemp())
    res = {}
    for name, model in (("smollm2-yarn2", yarn), ("smollm2-native", base)):
        res[name] = run_eval(
            model,
            tok,
            cfg,
            16384,
            step=0,
            out_dir=out / name / "eval",
            rank=0,
            arm=name,
            batch_tokens=4608,
            prefill_chunk=1024,
        )
    print("\n" + markdown([res["smollm2-native"], res["smollm2-yarn2"]]))
    acc = {k: {c["length"]: c["acc_pp"] for c in r["cells"]} for k, r in res.items()}
    assert acc["smollm2-native"][4584] >= 60, acc  # inside the 8192 training length: retrieves
    assert acc["smollm2-native"][13800] <= 40, acc  # 1.7x beyond it without YaRN: collapses
    assert acc["smollm2-yarn2"][13800] >= 60, acc  # YaRN x2, no fine-tuning: retrieves again
