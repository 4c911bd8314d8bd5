"""sp=2 generation equals one-rank generation (gloo, 2 CPU ranks): Ulysses-sharded prefill with
end padding (odd prompt lengths), the owner-rank broadcast of the first token, cache truncation,
replicated decode; even heads and SmolLM2-like uneven heads (3 q heads, 1 kv head); and a whole
run_eval under sp, written by rank 0 only."""

import pytest
import torch

from megablu.config.schema import EvalConfig, RopeConfig, YarnConfig
from megablu.eval.generate import greedy_generate
from tests.dist_utils import run_distributed

from .conftest import tiny_model

ROPE = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=2.0, original_max_position=256))
CASES = [(4, 2, 61), (4, 2, 64), (3, 1, 61)]  # (heads, kv heads, prompt length)
MAX_NEW = 6


def _model(h, kv):
    return tiny_model(vocab=257, d=8 * h, h=h, kv=kv, seed=5, rope=ROPE).double()


def _prompts(L):
    return torch.randint(0, 257, (2, L), generator=torch.Generator().manual_seed(L))


def _stops():
    """The token row 1 emits third and the one row 0 emits second (one rank, no stop): 85 and 249, neither
    earlier in either row, so each row stops at a different stop id, the first only at the third token."""
    ref = greedy_generate(_model(4, 2), _prompts(61), MAX_NEW)
    return int(ref[1, 2]), int(ref[0, 1])


def _worker(rank, world, out_dir):
    torch.set_num_threads(1)
    from megablu.data.tokenizer import ByteTokenizer
    from megablu.eval.harness import run_eval
    from megablu.parallel.groups import build_groups
    from megablu.parallel.ulysses import apply_ulysses

    g = build_groups(2)
    gens = []
    for h, kv, L in CASES:
        m = apply_ulysses(_model(h, kv), g)
        gens.append(greedy_generate(m, _prompts(L), MAX_NEW, sp_group=g.sp_group))
    # early stop at any of two stop ids: the ranks see group rank 0's tokens, so they stop at the same step
    m = apply_ulysses(_model(4, 2), g)
    gens.append(greedy_generate(m, _prompts(61), MAX_NEW, sp_group=g.sp_group, stop_ids=_stops()))
    cfg = EvalConfig(lengths=[301], tasks=["passkey"], n=2, max_new=MAX_NEW, pad=32)
    res = run_eval(m, ByteTokenizer(), cfg, 512, sp_group=g.sp_group, step=3, out_dir=out_dir, rank=rank, plot=False)
    return gens, res["samples"], res["sp"]


def test_sp2_generation_equals_one_rank(tmp_path):
    from megablu.data.tokenizer import ByteTokenizer
    from megablu.eval.harness import run_eval

    gens, samples, sp = run_distributed(_worker, 2, str(tmp_path / "sp"))
    for (h, kv, L), got in zip(CASES, gens):
        ref = greedy_generate(_model(h, kv), _prompts(L), MAX_NEW)
        assert torch.equal(got, ref), (h, kv, L)
    stops = _stops()
    ref = greedy_generate(_model(4, 2), _prompts(61), MAX_NEW, stop_ids=stops)
    assert torch.equal(gens[len(CASES)], ref) and (ref[:, 3:] == stops[0]).all()  # stopped after 3 tokens
    cfg = EvalConfig(lengths=[301], tasks=["passkey"], n=2, max_new=MAX_NEW, pad=32)
    ref = run_eval(_model(4, 2), ByteTokenizer(), cfg, 512, step=3, out_dir=tmp_path / "one", rank=0, plot=False)
    assert sp == 2 and samples == ref["samples"]
    assert sorted(p.name for p in (tmp_path / "sp").iterdir()) == ["step_3.json", "step_3.md"]


def _dp_worker(rank, world, out_dir):
    torch.set_num_threads(1)
    from megablu.data.tokenizer import ByteTokenizer
    from megablu.eval.harness import run_eval
    from megablu.parallel.groups import build_groups

    g = build_groups(1)  # 2 ranks, sp=1: two data-parallel groups
    cfg = EvalConfig(lengths=[269, 301], tasks=["passkey"], n=5, max_new=MAX_NEW, pad=32)
    res = run_eval(
        _model(4, 2),
        ByteTokenizer(),
        cfg,
        512,
        dp_group=g.dp_group,
        step=3,
        out_dir=out_dir,
        rank=rank,
        plot=False,
        batch_tokens=301,
    )  # several batches per rank
    both = [None, None]
    torch.distributed.all_gather_object(both, res["samples"])  # what each rank returned
    return both, res["cells"]


def test_dp_groups_split_the_prompts_and_gather_the_same_result(tmp_path):
    from megablu.data.tokenizer import ByteTokenizer
    from megablu.eval.harness import run_eval

    (s0, s1), c0 = run_distributed(_dp_worker, 2, str(tmp_path / "dp"))
    cfg = EvalConfig(lengths=[269, 301], tasks=["passkey"], n=5, max_new=MAX_NEW, pad=32)
    ref = run_eval(
        _model(4, 2), ByteTokenizer(), cfg, 512, step=3, out_dir=tmp_path / "one", rank=0, plot=False, batch_tokens=301
    )
    assert s0 == s1 == ref["samples"]
    timing = ("seconds", "prompts_per_s")
    strip = [{k: v for k, v in c.items() if k not in timing} for c in ref["cells"]]
    assert [{k: v for k, v in c.items() if k not in timing} for c in c0] == strip


SUITE_TASKS = ["niah_single_1", "niah_multikey_2", "vt", "tiny_cwe", "fwe"]


def _suite_cfg(data):
    from megablu.config.schema import LossEvalConfig

    return EvalConfig(
        lengths=[1400],
        tasks=SUITE_TASKS,
        n=2,
        pad=32,
        seed=4,
        task_defs={"tiny_cwe": {"family": "cwe", "common": 3, "freq_common": 4, "freq_uncommon": 1, "max_new": 24}},
        loss=LossEvalConfig(data=data, n=1, short_docs=2, short_min=200, short_max=900),
    )


def _suite_worker(rank, world, out_dir, data):
    torch.set_num_threads(1)
    from megablu.data.tokenizer import ByteTokenizer
    from megablu.eval.harness import run_eval
    from megablu.parallel.groups import build_groups
    from megablu.parallel.ulysses import apply_ulysses

    g = build_groups(2)
    m = apply_ulysses(_model(3, 1), g)  # SmolLM2-like uneven heads
    res = run_eval(
        m, ByteTokenizer(), _suite_cfg(data), 2048, sp_group=g.sp_group, step=1, out_dir=out_dir, rank=rank, plot=False
    )
    return res["samples"], res["cells"], res["loss"]


def test_sp2_suite_prompts_scores_and_loss_equal_one_rank(tmp_path):
    """The RULER-grade tasks and the held-out loss under sp=2 (Ulysses prefill, static cache,
    EOT stop broadcast) give the one-rank samples, cells and losses."""
    import numpy as np

    from megablu.data.shards import DatasetWriter
    from megablu.data.tokenizer import ByteTokenizer
    from megablu.eval.harness import run_eval

    tok = ByteTokenizer()
    data = tmp_path / "ds"
    meta = {"identity": tok.identity, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id}
    import sysconfig
    from pathlib import Path

    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    with DatasetWriter(data, meta, edges=(1024, 1 << 20)) as w:
        for i, (a, b) in enumerate([(0, 3000), (3000, 3301), (4000, 4777)]):
            w.add(
                np.asarray(tok.encode(text[a:b]), dtype=np.int64),
                "val",
                {"source": "stdlib", "license": "PSF", "key": f"t/{i}"},
            )
        w.finish()
    samples, cells, loss = run_distributed(_suite_worker, 2, str(tmp_path / "sp"), str(data))
    ref = run_eval(_model(3, 1), tok, _suite_cfg(str(data)), 2048, step=1, out_dir=tmp_path / "one", rank=0, plot=False)
    assert {s["task"] for s in samples} == set(SUITE_TASKS)
    assert samples == ref["samples"]
    strip = lambda cs: [{k: v for k, v in c.items() if k not in ("seconds", "prompts_per_s")} for c in cs]  # noqa
    assert strip(cells) == strip(ref["cells"])
    for a, b in zip(loss["by_length"] + [loss["short"]], ref["loss"]["by_length"] + [ref["loss"]["short"]]):
        assert a["tokens"] == b["tokens"] and a["digest"] == b["digest"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9)
