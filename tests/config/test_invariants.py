"""One test per config invariant: rejected with the field, the values and the fix."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megablu.config import ConfigError, load_config
from megablu.config.schema import eval_padded_len

ROOT = Path(__file__).resolve().parents[2]
EXT = ROOT / "configs" / "ext32k.yaml"


def errors(sets, world=2, device="cuda", path=EXT):
    try:
        load_config(path, sets, world_size=world, device=device)
    except ConfigError as e:
        return e.errors
    return []


def test_shipped_ext32k_is_valid():
    assert errors([]) == []


def test_load_for_command_prints_every_problem_and_returns_none(capsys):
    """The commands' one loader (megablu train/probe, eval, data mix, plan): a valid config comes back, an
    invalid one prints ConfigError's whole text (every problem) on stderr, nothing on stdout, and gives None."""
    from megablu.config import load_for_command

    assert load_for_command(EXT, [], world_size=2, device="cuda").name == load_config(EXT).name
    assert capsys.readouterr().err == ""
    bad = ["rope.yarn.original_max_position=1024", "schedule.min_lr=10"]
    assert load_for_command(EXT, bad, world_size=2, device="cuda") is None
    out, err = capsys.readouterr()
    with pytest.raises(ConfigError) as e:
        load_config(EXT, bad, world_size=2, device="cuda")
    assert out == "" and err == str(e.value) + "\n" and len(e.value.errors) == 2
    assert "rope.yarn: factor*original_max_position" in err and "schedule.min_lr=10" in err


def test_yarn_product_must_equal_window():
    errs = errors(["rope.yarn.original_max_position=1024"])  # the seed's silent default
    assert len(errs) == 1
    assert "2.0*1024 = 2048 != data.window 32768" in errs[0] and "factor=32" in errs[0]


def test_yarn_original_length_has_no_default():
    errs = errors(["rope.yarn={factor: 2.0}"])
    assert any(e.startswith("rope.yarn.original_max_position: required") for e in errs)


def test_wsd_needs_two_step_tail():
    assert errors(["schedule.decay_start=748"]) == []  # 750 - 2: allowed
    errs = errors(["schedule.decay_start=749"])
    assert any("decay_start=749 > train.max_steps-2 = 748" in e for e in errs)
    errs = errors(["schedule.decay_start=750"])  # the seed's CP_STABLE == CP_MAX_STEPS
    assert any("leaves no decay tail" in e for e in errs)


def test_warmup_before_decay():
    errs = errors(["schedule.warmup_steps=700"])
    assert any("warmup_steps=700 >= schedule.decay_start=675" in e for e in errs)


def test_eval_pad_rule_edges():
    assert eval_padded_len(32744, 24, 256) == 32768
    assert eval_padded_len(32745, 24, 256) == 33024
    assert errors(["eval.lengths=[1024, 4096, 32744]"]) == []
    errs = errors(["eval.lengths=[1024, 4096, 32745]"])
    assert len(errs) == 1 and "32745 + max_new 24 pads to 33024" in errs[0] and "32744" in errs[0]


def test_sp_must_divide_world_and_fit():
    errs = errors([], world=1)
    assert any("parallel.sp=2 > world size 1" in e for e in errs)
    errs = errors(["parallel.sp=4", "train.tokens_per_step=1048576"], world=6)
    assert any("parallel.sp=4 does not divide world size 6" in e for e in errs)


def test_tokens_per_step_exact_and_suggests_values():
    errs = errors(["train.tokens_per_step=1000000"])
    assert len(errs) == 1
    assert "1*32768*k*1" in errs[0] and "983040 (k=30) or 1015808 (k=31)" in errs[0]
    # with dp=2 (world 4, sp 2) 1,048,576 is still exact: k=16
    assert errors([], world=4) == []


def test_keep_every_must_land_on_saved_steps():
    """ext32k saves every 50 steps: keep_every must be one of its multiples, and needs periodic saves."""
    assert errors(["checkpoint.keep_every=250"]) == []
    errs = errors(["checkpoint.keep_every=260"])
    assert len(errs) == 1 and errs[0].startswith(
        "checkpoint.keep_every=260 is not a multiple of checkpoint.every_steps=50"
    )
    assert "step 260 is never saved (only multiples of 1300 would be kept)" in errs[0]
    assert errs[0].endswith("set checkpoint.keep_every=250 (the nearest multiple of 50)")
    for k, near in ((280, 300), (20, 50), (275, 250)):  # up, up from below the first multiple, a tie goes down
        assert errors([f"checkpoint.keep_every={k}"])[0].endswith(
            f"set checkpoint.keep_every={near} (the nearest multiple of 50)"
        )
    errs = errors(["checkpoint.every_steps=0", "checkpoint.keep_every=100"])
    assert len(errs) == 1 and errs[0].startswith(
        "checkpoint.keep_every=100 with checkpoint.every_steps=0: only the final checkpoint is saved"
    )
    assert "set checkpoint.every_steps=100 (or a divisor of it), or checkpoint.keep_every=0" in errs[0]
    errs = errors(["checkpoint.keep_every=-50"])
    assert len(errs) == 1 and errs[0].startswith("checkpoint.keep_every: Input should be greater than or equal to 0")


def test_keep_every_at_its_default_leaves_the_config_hash_alone():
    """Runs started before checkpoint.keep_every existed resume: tiny_cpu's hash is main's before it."""
    from megablu.config import config_hash, config_warnings

    def cfg(sets):
        return load_config(ROOT / "tests" / "configs" / "tiny_cpu.yaml", sets, world_size=1, device="cpu")

    # the runs before it trained with memory.loss chunked and memory.attention sdpa (the defaults then;
    # auto since, hashed as itself: a resume accepts both changes, train/resume.py RESUMABLE)
    old = ["memory.loss=chunked", "memory.attention=sdpa"]
    assert config_hash(cfg(old)) == config_hash(cfg(old + ["checkpoint.keep_every=0"])) == "786b2824aa40a632"
    assert config_hash(cfg(old + ["checkpoint.keep_every=20"])) != "786b2824aa40a632"
    # eval.string (STRING at eval, added 2026-12-05) the same way: hashed only when set
    assert config_hash(cfg(old + ["eval.string=null"])) == "786b2824aa40a632"
    assert config_hash(cfg(old + ["eval.string.local=8"])) != "786b2824aa40a632"
    # eval.string.beyond (2026-12-06) at its default keeps the hash of the runs before it (9533a9b's), and so
    # does the fixed shift those runs had, now named (variant fixed_shift, no attention factor): the authors'
    # variant, the default since, and a factor hash differently
    string = ["eval.string.variant=fixed_shift", "eval.string.shift=64", "eval.string.local=8"]
    assert config_hash(cfg(old + string + ["eval.string.attention_factor=1.0"])) == "70e138f0084275f1"
    assert config_hash(cfg(old + string + ["eval.string.attention_factor=1.07"])) != "70e138f0084275f1"
    assert config_hash(cfg(old + ["eval.string.shift_ratio=0.33", "eval.string.local=8"])) != "70e138f0084275f1"
    assert (
        config_hash(cfg(old + string))
        == config_hash(cfg(old + string + ["eval.string.beyond=0"]))
        == "70e138f0084275f1"
    )
    assert config_hash(cfg(old + string + ["eval.string.beyond=16360"])) != "70e138f0084275f1"
    steps = cfg([]).train.max_steps
    assert any(
        w.startswith(f"checkpoint.keep_every={steps + 20} > train.max_steps")
        for w in config_warnings(cfg([f"checkpoint.keep_every={steps + 20}"]))
    )


def test_bf16_on_cpu_rejected():
    errs = errors([], device="cpu")
    assert any("train.dtype=bf16 on a CPU run" in e for e in errs)


def test_unknown_key_and_missing_field():
    errs = errors(["train.max_step=10"])
    assert any(e.startswith("train.max_step: unknown key") for e in errs)
    errs = errors(["data.window=null"])
    assert any(e.startswith("data.window") for e in errs)


def test_every_violation_listed_at_once():
    errs = errors(
        [
            "rope.yarn.original_max_position=1024",
            "schedule.decay_start=750",
            "eval.lengths=[1024, 4096, 32745]",
            "train.tokens_per_step=1000000",
        ],
        device="cpu",
    )
    assert len(errs) == 5


def test_inherit_one_level(tmp_path):
    base = tmp_path / "a.yaml"
    base.write_text(yaml.safe_dump({"inherit": "b.yaml"}))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"inherit": "a.yaml", "name": "x"}))
    with pytest.raises(ConfigError, match="one level only"):
        load_config(tmp_path / "c.yaml")


def test_cli_check_exit_codes():
    # --no-files: the config alone (ext32k's data and parent live on the GPU box, not here)
    ok = subprocess.run(
        [sys.executable, "-m", "megablu.cli", "config", "check", str(EXT), "--world-size", "2", "--no-files"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "original_max_position: 16384" in ok.stdout
    # without it, the entry's preflight: the inputs this machine does not have are listed
    here = subprocess.run(
        [sys.executable, "-m", "megablu.cli", "config", "check", str(EXT), "--world-size", "2"],
        capture_output=True,
        text=True,
    )
    assert here.returncode == 2 and here.stdout == ""
    assert "data.path: data/blu has no manifest.json" in here.stderr and "init_from:" in here.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "megablu.cli",
            "config",
            "check",
            str(EXT),
            "--world-size",
            "2",
            "--set",
            "rope.yarn.original_max_position=1024",
            "--set",
            "eval.lengths=[32745]",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert "rope.yarn" in bad.stderr and "eval.lengths" in bad.stderr


def test_entry_rejects_before_any_rank_works(tmp_path):
    """launch/ext32k.py validates against WORLD_SIZE before init_distributed: exit 2, no run dir."""
    env = {"WORLD_SIZE": "1", "RANK": "0", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "ext32k.py"),
            "--config",
            str(EXT),
            "--set",
            f"runs_dir={tmp_path}/runs",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 2
    assert "parallel.sp=2 > world size 1" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_entry_preflight_lists_every_missing_input(tmp_path):
    """Missing parent, data without a manifest, a gate parent that is no eval result, a haystack
    that is no dataset, a tokenizer file that is not there: all listed at once, exit 2, before
    any rank or run dir exists."""
    (tmp_path / "data").mkdir()
    (tmp_path / "notes.json").write_text("{}")
    env = {"WORLD_SIZE": "2", "RANK": "0", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "ext32k.py"),
            "--config",
            str(EXT),
            "--set",
            f"runs_dir={tmp_path}/runs",
            "--set",
            f"init_from={tmp_path}/no_parent",
            "--set",
            f"data.path={tmp_path}/data",
            "--set",
            f"eval.gate.parent={tmp_path}/notes.json",
            "--set",
            f"eval.haystack={tmp_path}/nowhere@b2",
            "--set",
            "train.device=cpu",
            "--set",
            "tokenizer.kind=sentencepiece",
            "--set",
            "tokenizer.name=null",
            "--set",
            f"tokenizer.path={tmp_path}/gone.model",
            "--set",
            "train.dtype=fp32",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 2, r.stderr
    for field in ("init_from:", "data.path:", "eval.gate.parent:", "eval.haystack:", "tokenizer:"):
        assert field in r.stderr, (field, r.stderr)
    assert "not a megablu eval result" in r.stderr and f"{tmp_path}/nowhere has no manifest.json" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_extension_without_a_gate_is_warned():
    from megablu.config import config_warnings

    tiny = ROOT / "tests" / "configs" / "tiny_cpu_ext.yaml"
    cfg = load_config(tiny, ["init_from=runs/x"], world_size=2, device="cpu")
    assert any("eval.gate.parent" in w for w in config_warnings(cfg))
    gated = load_config(
        tiny,
        [
            "init_from=runs/x",
            "eval.final=true",
            "eval.gate.parent=runs/x",
            "eval.lengths=[232]",
            "eval.gate.short_lengths=[232]",
        ],
        world_size=2,
        device="cpu",
    )
    assert not any("eval.gate.parent" in w for w in config_warnings(gated))


# world size, device each shipped arm is meant for (tiny arms run on CPU ranks)
SHIPPED = {
    "tiny_cpu.yaml": (1, "cpu"),
    "tiny_cpu_ext.yaml": (2, "cpu"),
    "ext64k_4gpu.yaml": (4, "cuda"),
    "zero3_offload_params.yaml": (1, "cuda"),
    "zero2_offload_opt.yaml": (1, "cuda"),
    "zero3_offload_opt.yaml": (1, "cuda"),
    "frugal_1m_1gpu.yaml": (1, "cuda"),
    "quickstart_cpu.yaml": (1, "cpu"),
    "quickstart_cpu_ext.yaml": (2, "cpu"),
    "quickstart_gpu.yaml": (1, "cuda"),
    "quickstart_gpu_ext.yaml": (1, "cuda"),
}


SHIPPED_DIRS = ("configs", "tests/configs", "examples/quickstart", "experiments/*")
SHIPPED_FILES = sorted(p for d in SHIPPED_DIRS for p in ROOT.glob(f"{d}/*.yaml"))


def test_the_shipped_arms_are_found():
    """Every config directory of the layout is scanned (a moved folder would pass the test below vacuously)."""
    found = {str(p.parent.relative_to(ROOT)) for p in SHIPPED_FILES}
    assert {"configs", "tests/configs", "examples/quickstart", "experiments/smol32k"} <= found, found


@pytest.mark.parametrize("path", SHIPPED_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_arm_is_valid_for_its_launch(path):
    world, device = SHIPPED.get(path.name, (yaml.safe_load(path.read_text()).get("parallel", {}).get("sp", 2), "cuda"))
    if path.name.startswith("rep_"):
        world = 1
    load_config(path, world_size=world, device=device)  # raises ConfigError listing every violation


def test_sp_above_the_head_count_warns_with_the_cost():
    """sp=4 over 2 heads trains with zero heads on 2 of 4 ranks: legal (head padding), warned with the cost."""
    from megablu.config import config_warnings

    tiny = ROOT / "tests" / "configs" / "tiny_cpu_ext.yaml"
    cfg = load_config(
        tiny,
        ["parallel.sp=4", "model.n_heads=2", "model.n_kv_heads=1", "train.tokens_per_step=4096", "train.micro_batch=2"],
        world_size=4,
        device="cpu",
    )
    w = [x for x in config_warnings(cfg) if x.startswith("parallel.sp=4 > model.n_heads=2")]
    assert len(w) == 1 and "2 of the 4 ranks" in w[0] and "2x the work" in w[0] and "sp=2" in w[0]
    assert not any("model.n_heads" in x for x in config_warnings(load_config(tiny, world_size=2, device="cpu")))


def test_a_resume_may_change_when_checkpoints_are_saved_and_kept():
    """checkpoint.every_steps / keep / keep_every decide saving from now on (keep_every turned on for a run
    under way): a resume accepts them; another checkpoint field (save_final) is still refused."""
    from megablu.train.resume import resume_problems

    def cfg(sets):
        return load_config(ROOT / "tests" / "configs" / "tiny_cpu.yaml", sets, world_size=1, device="cpu")

    saved = cfg(["checkpoint.every_steps=3"]).model_dump(mode="json")
    now = cfg(["checkpoint.every_steps=2", "checkpoint.keep=1", "checkpoint.keep_every=4"])
    assert resume_problems(saved, now, 3) == []
    assert resume_problems(saved, cfg(["checkpoint.every_steps=3", "checkpoint.save_final=false"]), 3) == [
        "checkpoint.save_final: saved True, now False"
    ]


def test_a_graph_decode_that_cannot_run_is_refused_before_the_run():
    # configs/ext32k.yaml is sp=2: sequence-parallel decode is eager
    (e,) = errors(["eval.decode=graph"])
    assert "eval.decode=graph cannot run with parallel.sp=2" in e and "set eval.decode=auto" in e
    assert errors(["eval.decode=auto"]) == [] and errors(["eval.decode=eager"]) == []
    one = ["parallel.sp=1", "train.tokens_per_step=65536"]
    assert errors([*one, "eval.decode=static"], world=1) == []
    (e,) = errors([*one, "eval.decode=static", "eval.string={variant: authors}"], world=1)
    assert "eval.decode=static cannot run with eval.string is set" in e
    (e,) = errors([*one, "eval.decode=static", "parallel.zero_stage=3"], world=1)
    assert "parallel.zero_stage=3" in e
    assert any("captures CUDA graphs" in e for e in errors([*one, "eval.decode=graph"], world=1, device="cpu"))
