"""The planner's terms for memory.mlp_tiles and memory.offload_activations: hand-checked bytes,
GPU activations independent of depth when offloaded, the host memory they need, suggestions."""

import pytest

from megablu import plan
from megablu.config import load_config
from megablu.config.schema import ModelConfig

BLU05B = ModelConfig(n_layers=36, d_model=1024, n_heads=16, n_kv_heads=4, ffn_dim=2816, vocab_size=100352)
TINY = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=1000)
# TINY, cuda ops (test_plan.test_activation_terms_hand_checked): attn 660, mlp 1028 of which
# the ffn part (gate, up, down input) 3*2*128 = 768; h = input = 2*64; outside the layers 216
ATTN, MLP, FFN, H, OUT = 660, 1028, 768, 128, 2 * 64 + 2 * 2 * 16 + 24
# the attention backward's point (q = 64, kv = 32): residual grad 2*64 + the output's grad
# 2*64 + fp32 dq accumulator 4*64 + dk, dv expanded to the 4 q heads 2*2*64 (GQA) + dq, dk, dv
# 2*(64 + 2*32) + fp32 row sums 4*4
ATTN_BWD = 128 + 128 + 256 + 256 + 256 + 16


def test_hand_checked_parts():
    lb = plan.layer_bytes_per_token(TINY, "cuda")
    assert (lb["attn"], lb["mlp"], lb["mlp_ffn"], lb["h"]) == (ATTN, MLP, FFN, H)
    assert plan.layer_bytes_per_token(TINY, "torch")["mlp_ffn"] == 4 * 2 * 128  # + silu(gate)
    assert plan.outside_layers_per_token(TINY, "cuda") == OUT


def test_tiles_drop_the_saved_ffn_part_only_without_recompute():
    assert plan.saved_per_token(TINY, "none", "cuda", mlp_tiles=4) == 2 * (ATTN + MLP - FFN) + OUT
    for r in ("selective", "full"):  # these never saved the ffn part
        assert plan.saved_per_token(TINY, r, "cuda", mlp_tiles=4) == plan.saved_per_token(TINY, r, "cuda")


def test_tiles_shrink_the_backward_working_set():
    lb = plan.layer_bytes_per_token(TINY, "cuda")
    assert lb["attn_bwd"] == ATTN_BWD
    # untiled full: the whole layer rebuilt + grads in flight 2*(2F + d), above the attention point
    assert plan.layer_working_set(lb, "full") == ATTN + MLP + 2 * (2 * 128 + 64) > ATTN + ATTN_BWD
    # 4 tiles: the MLP point (attention + norm/y rebuilt, the ffn part per tile, ffn grads per
    # tile, residual grad + dx) falls below the attention backward's, which sets the working set
    mlp_point = ATTN + (MLP - FFN) + FFN / 4 + 2 * 2 * 128 / 4 + H + H
    assert mlp_point < ATTN + ATTN_BWD == plan.layer_working_set(lb, "full", 4)
    assert MLP / 4 + 2 * 2 * 128 / 4 + H + H < ATTN_BWD == plan.layer_working_set(lb, "selective", 4)
    assert plan.layer_working_set(lb, "none", 4) == ATTN_BWD
    # selective, untiled: the rebuilt MLP + its grads (1028 + 640) beat the attention point
    assert plan.layer_working_set(lb, "selective") == MLP + 2 * (2 * 128 + 64)
    # blu-0.5b, full recompute, 1M tokens (the backward is the peak): 8 tiles save the
    # working-set difference per token, minus the fp32 sums of the three MLP weights' grads
    t = 1048576
    e1, e8 = (plan.estimate(plan.Setup(BLU05B, t, recompute="full", loss_chunk=4096, mlp_tiles=n)) for n in (1, 8))
    assert e1.phase == e8.phase == "backward" and e8.per_token == e1.per_token
    lb = plan.layer_bytes_per_token(BLU05B, "cuda")
    saved = (plan.layer_working_set(lb, "full") - plan.layer_working_set(lb, "full", 8)) * t - 4 * 3 * 1024 * 2816
    assert e1.allocated - e8.allocated == pytest.approx(saved)
    assert saved / 1e9 > 19  # floored by the attention backward, not the MLP


def test_offload_gpu_activations_independent_of_depth_and_host_holds_the_rest():
    deep = TINY.model_copy(update={"n_layers": 8})
    for m in (TINY, deep):
        assert plan.saved_per_token(m, "selective", "cuda", offload=True) == 2 * (ATTN + H) + OUT
        assert plan.host_per_token(m, "selective", "cuda") == (m.n_layers - 1) * (ATTN + H)  # the last layer stays
    assert plan.saved_per_token(deep, "full", "cuda", offload=True) == 2 * H + OUT
    from megablu.memory.offload import KEEP_LAST

    assert plan.OFFLOAD_KEPT_LAYERS == KEEP_LAST  # the planner counts what the model keeps
    e = plan.estimate(plan.Setup(deep, 1024, recompute="full", loss_chunk=256, offload_activations=True))
    assert e.host == 7 * H * 1024 and e.host_gb == pytest.approx(7 * H * 1024 / 1e9)
    assert plan.estimate(plan.Setup(deep, 1024, recompute="full", loss_chunk=256)).host == 0


def test_offload_keep_moves_blocks_from_host_to_gpu():
    """memory.offload_keep = K: K blocks' saved sets stay on the GPU (+ one in flight), the other
    n - K on host; K = 1 is the default's accounting."""
    deep = TINY.model_copy(update={"n_layers": 8})
    per = ATTN + H
    assert plan.saved_per_token(deep, "selective", "cuda", offload=True, keep=1) == 2 * per + OUT
    assert plan.saved_per_token(deep, "selective", "cuda", offload=True, keep=5) == 6 * per + OUT
    assert plan.host_per_token(deep, "selective", "cuda", keep=5) == 3 * per
    s = plan.Setup(deep, 1024, recompute="selective", loss_chunk=256, offload_activations=True, offload_keep=5)
    assert plan.estimate(s).host == 3 * per * 1024
    assert "keep=5" in s.describe()
    # offload_fraction 0.5 of the 7 blocks before the last: 3 offloaded, 5 kept + 1 in flight on the GPU
    assert plan.host_per_token(deep, "selective", "cuda", fraction=0.5) == 3 * per
    assert plan.saved_per_token(deep, "selective", "cuda", offload=True, fraction=0.5) == 6 * per + OUT
    half = plan.Setup(deep, 1024, recompute="selective", loss_chunk=256, offload_activations=True, offload_fraction=0.5)
    assert plan.estimate(half).host == 3 * per * 1024 and "fraction=0.5" in half.describe()


def test_blu05b_at_1m_tokens_on_one_gpu():
    def est(**kw):
        return plan.estimate(plan.Setup(BLU05B, 1048576, loss_chunk=4096, **kw))

    assert est(recompute="selective").gpu_gb > 141  # 36 layers x 11 KB/token
    off = est(recompute="selective", offload_activations=True)
    assert off.gpu_gb < 0.8 * 141
    # host: 35 of the 36 layers (the last stays on the GPU) x (attention half 9284 B + h 2048 B) per token
    assert off.host_gb == pytest.approx(35 * (9284 + 2048) * 1048576 / 1e9)
    tiled = est(recompute="selective", offload_activations=True, mlp_tiles=8)
    assert tiled.gpu_gb < off.gpu_gb  # the MLP rebuild per tile
    # full + offload keeps only the layer inputs on host (the ALST recipe)
    assert est(recompute="full", offload_activations=True).host_gb == pytest.approx(35 * 2048 * 1048576 / 1e9)


def test_setup_from_config_and_describe():
    cfg = load_config("configs/l2.yaml", ["memory.mlp_tiles=8", "memory.offload_activations=true"])
    s = plan.Setup.from_config(cfg, gpus=1, window=65536)
    assert s.mlp_tiles == 8 and s.offload_activations
    assert "mlp_tiles=8 +act-offload" in s.describe()


def test_table_reports_host_memory_and_suggestion_respects_a_host_limit():
    cfg = load_config("configs/l2.yaml", [])
    rows = plan.fit_table(cfg, [1], plan.parse_tokens("1M"), 141.0)
    assert "memory.offload_activations" in rows[0]["suggestion"] and "GB pinned host per GPU" in rows[0]["suggestion"]
    limited = plan.fit_table(cfg, [1], plan.parse_tokens("1M"), 141.0, host_gb=10.0)
    assert "offload_activations" not in (limited[0]["suggestion"] or "")
    on = load_config("configs/l2.yaml", ["memory.offload_activations=true"])
    rows = plan.fit_table(on, [1, 2], plan.parse_tokens("1M"), 141.0)
    assert all(r["verdict"] == "comfortable" for r in rows)
    text = plan.format_table(rows, 141.0)
    assert "Pinned host memory for offloaded activations" in text and "1 GPUs 1M: 415.9 GB" in text
    assert "not checked against any host: pass --host-gb" in text  # no limit given: said so
    host_limited = plan.fit_table(on, [1, 2], plan.parse_tokens("1M"), 141.0, host_gb=300.0)
    assert [r["verdict"] for r in host_limited] == ["impossible", "comfortable"]  # 415.9 GB > 300; 2 GPUs: ~246
    assert "not checked" not in plan.format_table(host_limited, 141.0, 300.0)


def test_suggestions_obey_the_offload_invariant():
    s = plan.Setup(BLU05B, 1048576, recompute="none", loss_chunk=4096)
    assert plan.apply_change(s, "offload_activations") is None  # untiled MLP intermediates
    assert plan.apply_change(plan.apply_change(s, "mlp_tiles=8"), "offload_activations").offload_activations


def test_fit_table_refuses_rows_beyond_the_host_memory():

    cfg = load_config(
        "configs/ext32k.yaml",
        ["memory.recompute=full", "memory.mlp_tiles=16", "memory.offload_activations=true"],
        device="cuda",
    )
    free = plan.fit_table(cfg, [1], [2**21], 141.0)
    capped = plan.fit_table(cfg, [1], [2**21], 141.0, host_gb=110)
    assert free[0]["host_gb_per_gpu"] > 110 and free[0]["verdict"] != "impossible"
    assert capped[0]["verdict"] == "impossible" and "pinned host memory" in capped[0]["limiting"]


@pytest.mark.parametrize("name", ["cap_1m_l2.json", "cap_1m_l4.json", "cap_512k.json"])
def test_backward_peaks_of_the_h200_long_steps(name):
    """The steps whose peak is the backward (full recompute, MLP in 16 tiles, activations
    offloaded: experiments/speed/capacity.sh on the H200, 2026-12-03) against the planner: within 10%
    of the measured peak, never more than 1.5% below it; the host memory exactly."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "experiments" / "speed" / "results" / "2026-12-03"
    r = json.loads((results / name).read_text())[0]
    m = BLU05B.model_copy(update={"n_layers": r["n_layers"]})
    e = plan.estimate(
        plan.Setup(
            m,
            r["T"],
            zero_stage=0,
            optimizer=False,
            loss_chunk=r["loss_chunk"],
            ops="cuda",
            recompute="full",
            mlp_tiles=16,
            offload_activations=True,
        )
    )
    assert e.phase == "backward"
    assert -0.015 < e.allocated_gb / r["peak_gb"] - 1 < 0.10, (e.allocated_gb, r["peak_gb"])
    assert e.host_gb == pytest.approx(r["host_gb"], rel=1e-3)


# --------------------------------------------------------------------------- memory.loss / memory.attention
# experiments/speed/LOG.md, issue 17 (H200, d=1024, V=100352, bf16, summed CE): peak GB above the inputs of one
# fwd+bwd of the loss alone at T=32768, the returned grads included: megablu's chunk 4096, Liger accum fp32
MEASURED_LOSS_GB_32K = {"chunked": 4.59, "liger": 0.68}


@pytest.mark.parametrize("loss", ["chunked", "liger"])
def test_loss_footprint_matches_the_h200(loss):
    const, tok = plan.loss_bytes(BLU05B, 32768, 4096 if loss == "chunked" else 0, loss)  # Liger: its own chunks
    assert (const + tok * 32768) / 1e9 == pytest.approx(MEASURED_LOSS_GB_32K[loss], rel=0.02)


def test_liger_footprint_hand_checked():
    V, d = BLU05B.vocab_size, BLU05B.d_model
    # its chunk: next_pow2(ceil(T / ceil(V / d))) = next_pow2(ceil(32768 / 98)) = 512; 2048 at 128k; <= T
    assert [plan.memory.liger_chunk(BLU05B, t) for t in (32768, 131072, 100, 1)] == [512, 2048, 2, 1]
    # memory.loss_chunk: the largest of at most that many tokens it makes (chunk_mem_const 6: ceil(98/6) = 17,
    # next_pow2(ceil(32768/17)) = 2048; 13: 8 -> 4096); below its own chunk, its own; beyond T, T
    assert [plan.memory.liger_chunk(BLU05B, 32768, c) for c in (2048, 4096, 3000, 100, 65536)] == [
        2048,
        4096,
        2048,
        512,
        32768,
    ]
    # 32k: the end (fp32 dW + its bf16 cast, 6Vd) beats the loop (4Vd + bf16 logits 2*512*V); per token
    # dh (2d), the fp32 loss (4) and the label mask (1); 128k: the loop (4Vd + 2*2048*V)
    assert plan.loss_bytes(BLU05B, 32768, 0, "liger") == (6 * V * d, 2 * d + 5)
    assert plan.loss_bytes(BLU05B, 131072, 0, "liger") == (4 * V * d + 2 * 2048 * V, 2 * d + 5)
    # a short window: the loss's constant part makes the forward's end the peak, and the term says liger
    e = plan.estimate(plan.Setup(BLU05B, 1024, zero_stage=0, optimizer=False, recompute="full", loss="liger"))
    assert e.phase == "forward end" and e.terms["loss (liger, chunk 16)"] == 6 * V * d + (2 * d + 5) * 1024
    # at 32k with loss_chunk 4096 the loop's bf16 logits (2 * 4096 * V) beat the end's bf16 dW cast (2Vd)
    assert plan.loss_bytes(BLU05B, 32768, 4096, "liger") == (4 * V * d + 2 * 4096 * V, 2 * d + 5)


def test_fa4_backward_buffers_hand_checked():
    # TINY (q = 64, kv = 32): FA4 keeps fp32 dk/dv accumulators at the kv heads (2*4*32) instead of SDPA's
    # dk, dv expanded to the query heads (2*2*64), and two fp32 row scratches per head (2*4*4) instead of one
    assert plan.layer_bytes_per_token(TINY, "cuda")["attn_bwd"] == ATTN_BWD
    assert plan.layer_bytes_per_token(TINY, "cuda", attention="fa4")["attn_bwd"] == ATTN_BWD - 256 + 256 - 16 + 32
    # MHA: no accumulators for dk/dv in either
    mha = TINY.model_copy(update={"n_kv_heads": 4})
    assert (
        plan.layer_bytes_per_token(mha, "cuda", attention="fa4")["attn_bwd"]
        == plan.layer_bytes_per_token(mha, "cuda")["attn_bwd"] + 16
    )


def test_kernel_choices_from_config():
    cfg = load_config("configs/l2.yaml", ["memory.loss=liger", "memory.attention=fa4"])
    s = plan.Setup.from_config(cfg, gpus=1, window=32768)
    assert (s.loss, s.attention) == ("liger", "fa4")
    assert "loss=liger loss_chunk=4096" in s.describe() and "attention=fa4" in s.describe()  # base.yaml's chunk
    # Liger's loss needs no loss_chunk: the planner never suggests one to it
    assert plan.apply_change(s, "loss_chunk=4096") is None
    assert plan.Setup.from_json(s.to_json()) == s
    # a probe.json written before these fields: today's kernels
    old = {k: v for k, v in s.to_json().items() if k not in ("loss", "attention")}
    assert (plan.Setup.from_json(old).loss, plan.Setup.from_json(old).attention) == ("chunked", "sdpa")
