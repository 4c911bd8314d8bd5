"""Issue 8's replication configs (experiments/replication/run.sh) pass every invariant, and the arms
differ from each other only in their data: same parent, same YaRN, same token budget."""

import re
from pathlib import Path

import pytest

from megablu.config import ConfigError, load_config
from megablu.config.schema import eval_padded_len

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "experiments" / "replication"
REP = ["rep_pretrain", "rep_ext_fit", "rep_ext_trunc", "rep_smollm2_32k"]


def load(name, sets=(), device="cuda"):
    folder = ROOT / "experiments" / "ruler_baselines" if name == "rep_smollm2_32k" else CFG
    return load_config(folder / f"{name}.yaml", list(sets), world_size=1, device=device)


@pytest.mark.parametrize("name", REP)
def test_rep_config_is_valid_on_one_gpu(name):
    cfg = load(name)
    assert cfg.parallel.sp == 1
    assert cfg.train.tokens_per_step % (cfg.train.micro_batch * cfg.data.window) == 0


def test_arms_extend_the_parent_x4_with_the_same_budget():
    parent, fit, trunc = load("rep_pretrain"), load("rep_ext_fit"), load("rep_ext_trunc")
    for arm in (fit, trunc):
        y = arm.rope.yarn
        assert y.original_max_position == parent.data.window and y.factor == 4
        assert y.factor * y.original_max_position == arm.data.window == 4 * parent.data.window
        assert arm.model == parent.model and arm.tokenizer == parent.tokenizer
        assert arm.rope.theta == parent.rope.theta
    budget = lambda c: (c.train.max_steps, c.train.tokens_per_step, c.schedule)  # noqa: E731
    assert budget(fit) == budget(trunc)
    assert (fit.data.mode, trunc.data.mode) == ("fit", "truncate")
    # the fit arm's documents fit the new window (bucket b1 = 4k-8k tokens), the control's are longer
    assert fit.data.bucket == "b1" and trunc.data.bucket.split(",")[0] == "b2"


def test_eval_spans_256_to_the_new_window():
    fit = load("rep_ext_fit")
    L = fit.eval.lengths
    assert L[0] == 256 and eval_padded_len(L[-1], fit.eval.max_new, fit.eval.pad) == fit.data.window
    assert set(fit.eval.tasks) == {"passkey", "needle"} and fit.eval.n >= 300


def test_script_gate_lengths_are_evaluated():
    script = (ROOT / "experiments" / "replication" / "run.sh").read_text()
    h200 = script[script.index("  h200)") : script.index("  cpu)")]
    lengths = [int(x) for x in re.search(r"LENGTHS=\(([\d ]+)\)", h200).group(1).split()]
    short = [int(x) for x in re.search(r"SHORT=\(([\d ]+)\)", h200).group(1).split()]
    assert lengths == load("rep_ext_fit").eval.lengths
    assert set(short) <= set(lengths) and max(short) + 24 <= load("rep_pretrain").data.window


def test_cpu_rehearsal_overrides_are_valid():
    """The tiny shapes the script's REP_SCALE=cpu passes (window 256 -> 1024)."""
    model = [
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=4",
        "model.n_kv_heads=4",
        "model.ffn_dim=176",
        "train.dtype=fp32",
        "train.device=cpu",
        "train.probe_steps=0",
    ]
    load(
        "rep_pretrain",
        model
        + [
            "data.window=256",
            "train.max_steps=40",
            "train.tokens_per_step=4096",
            "train.micro_batch=16",
            "schedule.warmup_steps=4",
            "schedule.decay_start=32",
            "eval.lengths=[128,232]",
        ],
        device="cpu",
    )
    ext = model + [
        "rope.yarn.original_max_position=256",
        "data.window=1024",
        "train.max_steps=6",
        "train.tokens_per_step=2048",
        "train.micro_batch=2",
        "schedule.warmup_steps=1",
        "schedule.decay_start=4",
        "eval.lengths=[128,232,488,1000]",
    ]
    load("rep_ext_fit", ext + ["data.bucket=b0"], device="cpu")
    load("rep_ext_trunc", ext, device="cpu")


def test_a_wrong_yarn_original_is_refused():
    with pytest.raises(ConfigError, match="factor\\*original_max_position"):
        load("rep_ext_fit", ["rope.yarn.original_max_position=1024"])
