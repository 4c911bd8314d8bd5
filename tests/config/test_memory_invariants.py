"""memory.mlp_tiles / memory.offload_activations: YAML fields, one test per invariant
(rejected with the field, the values and the fix), the warning, and the combinations allowed."""

import pytest

from megablu.config import config_warnings, load_config
from megablu.config.schema import MemoryConfig
from megablu.utils.liger import liger_chunk_tokens

from .test_invariants import EXT, errors


def test_fields_from_yaml_and_defaults():
    assert MemoryConfig().mlp_tiles == 1 and MemoryConfig().offload_activations is False
    cfg = load_config(
        EXT,
        ["memory.mlp_tiles=8", "memory.offload_activations=true", "memory.recompute=full"],
        world_size=2,
        device="cuda",
    )
    assert cfg.memory.mlp_tiles == 8 and cfg.memory.offload_activations is True
    assert any(e.startswith("memory.mlp_tiles") for e in errors(["memory.mlp_tiles=0"]))


@pytest.mark.parametrize(
    "sets",
    [
        ["memory.recompute=selective", "memory.mlp_tiles=16"],
        ["memory.recompute=selective", "memory.offload_activations=true"],
        # full + offload: the layer inputs (the checkpoints) go to host; ALST's recipe, kept
        ["memory.recompute=full", "memory.offload_activations=true", "memory.mlp_tiles=4"],
        ["memory.recompute=none", "memory.offload_activations=true", "memory.mlp_tiles=8"],
    ],
)
def test_combinations_allowed(sets):
    assert errors(sets) == []


def test_tiles_at_most_tokens_per_rank():
    # ext32k: window 32768, sp 2, micro_batch 1 -> 16384 tokens per rank
    assert errors(["memory.mlp_tiles=16384"]) == []
    errs = errors(["memory.mlp_tiles=16385"])
    assert len(errs) == 1
    assert "memory.mlp_tiles=16385 > tokens per rank 16384" in errs[0] and "1*ceil(32768/2)" in errs[0]
    assert "set memory.mlp_tiles <= 16384" in errs[0]


def test_offload_of_untiled_mlp_intermediates_rejected():
    errs = errors(["memory.recompute=none", "memory.offload_activations=true"])
    assert len(errs) == 1
    assert errs[0].startswith("memory.offload_activations with memory.recompute=none and memory.mlp_tiles=1")
    assert "set memory.recompute=selective (or full), or memory.mlp_tiles >= 2" in errs[0]


def test_offload_on_cpu_rejected():
    errs = errors(["memory.offload_activations=true", "memory.recompute=selective", "train.dtype=fp32"], device="cpu")
    assert errs == [
        "memory.offload_activations on a CPU run has no effect (activations already live in host memory); set it false"
    ]


def test_tiles_without_recompute_warns():
    cfg = load_config(EXT, ["memory.recompute=none", "memory.mlp_tiles=4"], world_size=2, device="cuda")
    assert any(w.startswith("memory.mlp_tiles>1 with memory.recompute=none") for w in config_warnings(cfg))
    cfg = load_config(EXT, ["memory.recompute=selective", "memory.mlp_tiles=4"], world_size=2, device="cuda")
    assert not any("mlp_tiles" in w for w in config_warnings(cfg))


# --------------------------------------------------------------------------- memory.loss / memory.attention
def test_kernel_field_defaults():
    """loss: auto (liger where the run is on CUDA and liger_kernel imports, else chunked: ops/cross_entropy.py);
    attention: auto (fa4 where it takes the tensors and flash_attn.cute imports, else sdpa: ops/attention.py;
    the H200 validated fa4 on 2026-12-04)."""
    assert MemoryConfig().loss == "auto" and MemoryConfig().attention == "auto"
    cfg = load_config(EXT, ["memory.loss=liger", "memory.attention=fa4"], world_size=2, device="cuda")
    assert (cfg.memory.loss, cfg.memory.attention) == ("liger", "fa4")
    assert any(e.startswith("memory.loss") for e in errors(["memory.loss=cce"]))
    assert any(e.startswith("memory.attention") for e in errors(["memory.attention=flash"]))


def test_auto_loss_is_never_a_config_error(monkeypatch):
    """auto falls back to chunked: nothing to refuse on a CPU run, nothing to import before a CUDA one."""
    from megablu.ops import cross_entropy
    from megablu.train.preflight import Context, kernel_problems

    assert errors(["memory.loss=auto", "train.dtype=fp32"], device="cpu") == []

    def missing():
        raise ModuleNotFoundError("No module named 'liger_kernel'")

    monkeypatch.setattr(cross_entropy, "_liger_func", missing)
    cfg = load_config(EXT, ["memory.loss=auto"], world_size=2, device="cuda")
    assert kernel_problems(Context(cfg, device="cuda")) == []


def test_kernels_on_cpu_rejected_with_the_fix():
    errs = errors(["memory.loss=liger", "memory.attention=fa4", "train.dtype=fp32"], device="cpu")
    assert (
        "memory.loss=liger on a CPU run: Liger's fused linear cross-entropy is a Triton GPU kernel; set "
        "memory.loss=chunked" in errs
    )
    assert (
        "memory.attention=fa4 on a CPU run: FlashAttention-4 runs on SM90 GPUs only; set memory.attention=sdpa" in errs
    )


@pytest.mark.parametrize(
    "sets,expect",
    [
        (
            ["model.head_dim=36"],
            "memory.attention=fa4 with head_dim 36: FlashAttention-4 takes head_dim 8..256, a "
            "multiple of 8, on SM90; set memory.attention=sdpa",
        ),
        (["model.head_dim=264"], "memory.attention=fa4 with head_dim 264"),
        (
            ["data.doc_mask=true", "data.mode=pack"],
            "memory.attention=fa4 with data.doc_mask=true: FlashAttention-4 runs plain causal attention here, document "
            "masking runs on FlexAttention; set memory.attention=sdpa",
        ),
        (
            ["train.dtype=fp32"],
            "memory.attention=fa4 with train.dtype=fp32: FlashAttention-4 takes bf16/fp16 inputs "
            "only; set train.dtype=bf16 or memory.attention=sdpa",
        ),
    ],
)
def test_fa4_limits_are_config_errors(sets, expect):
    errs = errors(["memory.attention=fa4", *sets])
    assert len(errs) == 1 and errs[0].startswith(expect), errs
    assert errors(["memory.attention=sdpa", *sets]) == []


def test_liger_takes_the_loss_chunk_and_warns_where_it_does_nothing():
    """memory.loss_chunk sizes Liger's chunks too (ops/cross_entropy.py): no warning where it widens them, or at 0;
    a warning where it is below Liger's own chunk and so changes nothing."""
    for chunk in (4096, 0):
        cfg = load_config(EXT, ["memory.loss=liger", f"memory.loss_chunk={chunk}"], world_size=2, device="cuda")
        assert cfg.memory.loss_chunk == chunk
        assert not any("loss_chunk" in w for w in config_warnings(cfg))
    cfg = load_config(EXT, ["memory.loss=liger", "memory.loss_chunk=4"], world_size=2, device="cuda")
    tokens = cfg.train.micro_batch * -(-cfg.data.window // cfg.parallel.sp)
    own = liger_chunk_tokens(tokens, cfg.model.d_model, cfg.model.vocab_size)
    assert own > 4
    assert (
        f"memory.loss_chunk=4 with memory.loss=liger has no effect here: Liger's own chunk at {tokens} tokens per "
        f"rank is {own} tokens, and loss_chunk only widens it; set memory.loss_chunk=0 or a value >= {own}"
    ) in config_warnings(cfg)


def test_preflight_names_a_kernel_library_that_does_not_import(monkeypatch):
    """Where the run starts (device cuda), the chosen library must import: before any rank works."""
    from megablu.ops import attention, cross_entropy
    from megablu.train.preflight import Context, kernel_problems

    def missing(name):
        def f():
            raise ModuleNotFoundError(f"No module named '{name}'")

        return f

    monkeypatch.setattr(cross_entropy, "_liger_func", missing("liger_kernel"))
    monkeypatch.setattr(attention, "_fa4_func", missing("flash_attn"))
    cfg = load_config(EXT, ["memory.loss=liger", "memory.attention=fa4"], world_size=2, device="cuda")
    probs = kernel_problems(Context(cfg, device="cuda"))
    assert probs == [
        "memory.loss=liger: liger_kernel is not importable (ModuleNotFoundError: No module named 'liger_kernel'); "
        "install liger-kernel (pip install liger-kernel==0.8.5, the version tested) or set memory.loss=chunked",
        "memory.attention=fa4: flash_attn.cute is not importable (ModuleNotFoundError: No module named 'flash_attn'); "
        "install flash-attn-4 (pip install flash-attn-4==4.0.0b40, the version tested) or set memory.attention=sdpa",
    ]
    # not asked for, or no device known (config check without --device): nothing imported, nothing said
    assert kernel_problems(Context(load_config(EXT, [], world_size=2, device="cuda"), device="cuda")) == []
    assert kernel_problems(Context(cfg, device=None)) == []
    monkeypatch.setattr(cross_entropy, "_liger_func", lambda: object())
    monkeypatch.setattr(attention, "_fa4_func", lambda: object())
    assert kernel_problems(Context(cfg, device="cuda")) == []


def test_the_preflight_runs_the_kernel_check(monkeypatch):
    """check() -> run_checks(): the import check is one of CHECKS (what the entry and `config check` run)."""
    from megablu.ops import cross_entropy
    from megablu.train.preflight import Context, run_checks

    def missing():
        raise ModuleNotFoundError("No module named 'liger_kernel'")

    monkeypatch.setattr(cross_entropy, "_liger_func", missing)
    cfg = load_config(EXT, ["memory.loss=liger"], world_size=2, device="cuda")
    probs = run_checks(Context(cfg, world_size=2, device="cuda", hash=False))
    assert any(p.startswith("memory.loss=liger: liger_kernel is not importable") for p in probs), probs
    assert not any(p.startswith("memory.") for p in run_checks(Context(cfg, world_size=2, device="cpu", hash=False)))


def test_config_hash_unchanged_by_the_kernel_fields_at_their_defaults():
    """Runs started before memory.loss/attention existed keep their hash with the behaviour of then
    (tiny_cpu's hash on main before them, 786b2824aa40a632, checked by hand): loss=chunked, attention=sdpa.
    auto (loss's and attention's default since 2026-12-04), liger and fa4 are other values; a resume accepts
    a memory.loss or memory.attention change (train/resume.py, test_a_resume_accepts_a_loss_change)."""
    from megablu.config import config_hash

    def h(sets, device="cpu"):
        return config_hash(load_config("tests/configs/tiny_cpu.yaml", sets, world_size=1, device=device))

    old = ["memory.loss=chunked", "memory.attention=sdpa"]
    assert h(old) == "786b2824aa40a632"
    assert (
        len(
            {
                h(old),
                h([]),
                h(["memory.loss=liger", "memory.attention=sdpa"], None),
                h(["memory.loss=chunked", "memory.attention=fa4", "train.dtype=bf16"], None),
                h(["memory.loss=chunked"]),
            }
        )
        == 5
    )  # the last: attention at its default, auto


def test_a_resume_accepts_a_loss_change():
    """A run saved with memory.loss=chunked (the default before auto) continues under auto, or liger:
    the same summed loss, computed by another kernel; another memory field is still refused."""
    from megablu.train.resume import resume_problems

    saved = load_config(EXT, ["memory.loss=chunked"], world_size=2, device="cuda").model_dump(mode="json")
    for loss in ("auto", "liger"):
        assert resume_problems(saved, load_config(EXT, [f"memory.loss={loss}"], world_size=2, device="cuda"), 5) == []
    # the attention kernel likewise (sdpa, the default before auto -> auto or fa4)
    for att in ("auto", "fa4"):
        now = load_config(EXT, ["memory.loss=chunked", f"memory.attention={att}"], world_size=2, device="cuda")
        assert resume_problems({**saved, "memory": {**saved["memory"], "attention": "sdpa"}}, now, 5) == []
    now = load_config(EXT, ["memory.loss=auto", "memory.recompute=full"], world_size=2, device="cuda")
    assert resume_problems(saved, now, 5) == [f"memory.recompute: saved {saved['memory']['recompute']!r}, now 'full'"]


def test_a_resume_names_a_loss_kernel_that_differs_from_the_last_session(tmp_path):
    """memory.loss=auto picks by what imports: the session resumed at step 30 ran liger, this one runs
    chunked (liger_kernel missing here) -> one line naming both; the same kernel, or no record -> None."""
    import json

    from megablu.train.resume import loss_change

    def probe(name, loss):
        setup = {"ops": "torch"} if loss is None else {"ops": "torch", "loss": loss}
        (tmp_path / name).write_text(json.dumps({"steps": 3, "setup": setup}))

    assert loss_change(tmp_path, 50, "chunked") is None  # no probe files
    probe("probe.json", None)  # a run from before the record
    assert loss_change(tmp_path, 50, "chunked") is None
    probe("probe.json", "chunked")
    probe("probe.step30.json", "liger")
    probe("probe.step60.json", "chunked")  # a later session: not before 50
    note = loss_change(tmp_path, 50, "chunked")
    assert note and "runs chunked now" in note and "from step 30 ran liger" in note, note
    assert loss_change(tmp_path, 50, "liger") is None
    assert "from step 0 ran chunked" in loss_change(tmp_path, 20, "liger")
    probe("probe.step50.json", "liger")  # an earlier attempt at resuming at 50 (it saved nothing)
    assert "from step 50 ran liger" in loss_change(tmp_path, 50, "chunked")


def test_offload_keep_and_fraction_bounds_warnings_and_hash():
    """memory.offload_keep / offload_fraction: a setting that offloads no block is refused with the bound
    (keeping every block; a fraction of the rest that rounds to none); out of range is a field error; either
    without offload_activations is a warning; at their defaults (1, 1.0) a run's hash is the one from before."""
    from megablu.config import config_hash

    n = load_config(EXT, [], world_size=2, device="cuda").model.n_layers
    on = ["memory.offload_activations=true"]
    assert errors(on + [f"memory.offload_keep={n - 1}"]) == errors(on + ["memory.offload_fraction=0.75"]) == []
    assert errors(on + [f"memory.offload_keep={n}"]) == [
        f"memory.offload_keep={n} with model.n_layers={n}: every block would keep its activations on the GPU, so "
        f"nothing is offloaded; set memory.offload_keep<={n - 1}, or memory.offload_activations=false"
    ]
    assert errors(on + ["memory.offload_fraction=0.01"]) == [
        f"memory.offload_fraction=0.01 of the {n - 1} blocks before the last memory.offload_keep=1 is none of them: "
        f"nothing is offloaded; set memory.offload_fraction>={1 / (n - 1):.3g}, or memory.offload_activations=false"
    ]
    for bad, why in (
        ("offload_keep=0", "greater than or equal to 1"),
        ("offload_fraction=1.5", "less than or equal to 1"),
    ):
        field = bad.split("=")[0]
        assert any(e.startswith(f"memory.{field}: Input should be {why}") for e in errors(on + [f"memory.{bad}"]))
    w = config_warnings(
        load_config(EXT, ["memory.offload_keep=4", "memory.offload_fraction=0.5"], world_size=2, device="cuda")
    )
    for field, value in (("offload_keep", "4"), ("offload_fraction", "0.5")):
        assert f"memory.{field}={value} without memory.offload_activations has no effect (nothing is offloaded)" in w

    def h(sets):
        return config_hash(
            load_config(
                "tests/configs/tiny_cpu.yaml",
                ["memory.loss=chunked", "memory.attention=sdpa"] + sets,
                world_size=1,
                device="cpu",
            )
        )

    assert h(["memory.offload_keep=1", "memory.offload_fraction=1.0"]) == "786b2824aa40a632"
    assert len({"786b2824aa40a632", h(["memory.offload_keep=2"]), h(["memory.offload_fraction=0.5"])}) == 3
