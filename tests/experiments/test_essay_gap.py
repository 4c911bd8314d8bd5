"""experiments/ruler_baselines/essay_gap.py's arms change what they say and nothing else: `start` takes the
essay haystack from its first sentence in every prompt (RULER's and lm-eval's haystack[:num_haystack]),
`nospace` renders the answer prefix as lm-eval's gen_prefix under a chat template (RULER's " The special
magic ..." without its leading space); `ruler` is megablu's task as it is. Outside the block the task is
megablu's again."""

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


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    import json

    from tests.hf_tok import write_chat_tokenizer

    d = write_chat_tokenizer(tmp_path_factory.mktemp("chat"), ESSAY[:3000] + " What is the special magic uuid?", 400)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return load_tokenizer(TokenizerConfig(kind="hf", path=str(d)))


def _prompt(index, tok=None):
    tok = tok or load_tokenizer(TokenizerConfig(kind="byte"))
    b = make_ruler_builder("ruler_niah_single_3", RULER_PRESETS["ruler_niah_single_3"], tok, 0, 4, "auto", essay=ESSAY)
    p = b.build(2000, index)
    return tok.decode(list(p.ids)), p.meta["offset"]


@pytest.mark.parametrize("arm", ["ruler", "start", "nospace", "start_nospace"])
def test_each_arm_builds_what_it_names(arm, chat_tok):
    import essay_gap

    with essay_gap.patched(arm):
        prompts = [_prompt(i, chat_tok) for i in range(4)]
        plain = _prompt(0)  # no chat template: RULER's and lm-eval's answers follow the question after a space
    start, prefix = essay_gap.ARMS[arm]
    offsets = {off for _, off in prompts}
    if start == "start":  # the stream's first word, every prompt
        assert offsets == {0} and all(
            t.split("afterwards.\n", 1)[1].lstrip().startswith("Sentence number 0 is") for t, _ in prompts
        )
    else:  # a window drawn per prompt
        assert len(offsets) == 4
    for text, _ in prompts:
        tail = "<|im_start|>assistant\n" + ("The" if prefix == "lm-eval" else " The") + " special magic uuid"
        assert tail in text, text[-200:]
    assert "mentioned in the provided text? The special magic uuid" in plain[0]
    again = _prompt(0, chat_tok)  # unpatched after the block
    assert again == prompts[0] if arm == "ruler" else again != prompts[0]
