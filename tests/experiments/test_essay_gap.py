"""experiments/ruler_baselines/essay_gap.py's arms change what they say and nothing else: `start` takes the
essay haystack from its first sentence in every prompt (RULER's and lm-eval's haystack[:num_haystack]),
`nospace` renders the answer prefix as lm-eval's gen_prefix (RULER's " The special magic ..." without its
leading space); `ruler` is megablu's task as it is. Outside the block the task is megablu's again."""

import sys
from pathlib import Path

import pytest

from megablu.config.ruler_tasks import RULER_PRESETS
from megablu.config.schema import TokenizerConfig
from megablu.data.tokenizer import load_tokenizer
from megablu.eval.ruler import make_ruler_builder

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "ruler_baselines"))

ESSAY = "".join(f"Sentence number {i} is here. " for i in range(2000))


def _prompt(index):
    tok = load_tokenizer(TokenizerConfig(kind="byte"))
    b = make_ruler_builder("ruler_niah_single_3", RULER_PRESETS["ruler_niah_single_3"], tok, 0, 4, "auto", essay=ESSAY)
    p = b.build(2000, index)
    return tok.decode(list(p.ids)), p.meta["offset"]


@pytest.mark.parametrize("arm", ["ruler", "start", "nospace", "start_nospace"])
def test_each_arm_builds_what_it_names(arm):
    import essay_gap

    with essay_gap.patched(arm):
        prompts = [_prompt(i) for i in range(4)]
    start, prefix = essay_gap.ARMS[arm]
    offsets = {off for _, off in prompts}
    if start == "start":  # the first sentence end of the stream, every prompt
        assert offsets == {len("Sentence number 0 is here.")}
    else:  # a window drawn per prompt
        assert len(offsets) == 4
    for text, _ in prompts:
        tail = "mentioned in the provided text?" + ("The" if prefix == "lm-eval" else " The") + " special magic uuid"
        assert tail in text, text[-200:]
    assert _prompt(0) == prompts[0] if arm == "ruler" else _prompt(0) != prompts[0]  # unpatched again after
