"""experiments/recipe_4x (issue 44's plan): every arm's YAML loads with megablu's config loader, passes the
training entry's preflight once the data paths it names point at stand-ins (they are overridable), the
budgets are equal and >= 40M positions, the arms differ only as the README says, and the README's commands
parse with megablu's CLI."""

import re
import shlex
import sysconfig
from pathlib import Path

import pytest
import yaml

from megablu.config.load import load_config, load_raw
from megablu.config.schema import TokenizerConfig

ROOT = Path(__file__).resolve().parents[2]
DIR = ROOT / "experiments" / "recipe_4x"
ARMS = ("long_only", "recipe", "recipe_evallike", "yarn_untrained")
TRAINED = ("long_only", "recipe", "recipe_evallike")
TOK = TokenizerConfig(kind="tiktoken_file", path="megablu:stdlib4k")
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _cfg(arm, sets=()):
    return load_config(DIR / f"{arm}.yaml", list(sets), world_size=1, device="cuda")


def _dump(arm) -> dict:
    return _cfg(arm).model_dump(mode="json")


def test_the_folder_holds_the_arms():
    assert sorted(p.stem for p in DIR.glob("*.yaml")) == sorted(ARMS)


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_loads(arm):
    cfg = _cfg(arm)
    assert cfg.name == f"r4x_{arm}"
    assert cfg.eval.suite == "ruler" and len(cfg.eval.tasks) == 11 and cfg.eval.n >= 100
    assert cfg.eval.lengths == [1024, 4096, 8192, 16384, 32768]
    assert cfg.eval.loss.sets == {"essays": "megablu:essays"} and cfg.eval.loss.data


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """A corpus (b0 fills a 32k window in mode pack, b3 has a document) and synthetic sets of each profile,
    in the stdlib4k tokenizer."""
    from megablu.data.build import Source, build_dataset
    from megablu.data.synth import synth_dataset
    from megablu.data.synth_disjoint import disjoint_dataset

    root = tmp_path_factory.mktemp("r4x")
    corpus = root / "corpus"
    build_dataset(
        [Source(str(STDLIB / p), include=["*.py"]) for p in ("json", "email", "asyncio")],
        TOK,
        corpus,
        val_fraction=0.2,
        workers=1,
        progress=False,
    )
    disjoint_dataset(
        root / "synth_disjoint", TOK, lengths=[(1000, 3000)], docs=6, filler_data=str(corpus), progress=False
    )
    synth_dataset(
        root / "synth_evallike",
        TOK,
        lengths=[(1000, 3000)],
        docs=6,
        fillers=("kv", "text", "repeat"),
        filler_data=str(corpus),
        progress=False,
    )
    return root


def _overrides(arm, root) -> list[str]:
    """Every data_cache/ path the arm names, pointed at the stand-ins (the parent: none, YaRN allowed then)."""
    sets = [
        "tokenizer={kind: tiktoken_file, path: 'megablu:stdlib4k'}",
        f"eval.haystack={root / 'corpus'}",
        f"eval.loss.data={root / 'corpus'}",
        "init_from=null",
        "rope.allow_yarn_from_scratch=true",
        "data.max_epochs=.inf",
    ]
    data = load_raw(DIR / f"{arm}.yaml")["data"]
    if data.get("mix"):
        mix = [{**m, "path": str(root / Path(m["path"]).name), "max_epochs": float("inf")} for m in data["mix"]]
        sets.append("data.mix=" + yaml.safe_dump(mix, default_flow_style=True, width=10**6).strip())
    else:
        sets.append(f"data.path={root / 'corpus'}")
    return sets


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_passes_preflight_with_its_data_paths_overridden(arm, stand_ins):
    """Without the files the entry's checks name the arm's data paths; with them overridden to stand-ins
    (the same keys a device run sets) the whole preflight passes and no data_cache/ path is left."""
    from megablu.config import ConfigError
    from megablu.train.preflight import check

    with pytest.raises(ConfigError) as e:
        check(DIR / f"{arm}.yaml", [], world_size=1, device="cuda", files=True)
    assert "data_cache/r4x/corpus" in str(e.value) and "data_cache/r4x/smollm2" in str(e.value)
    sets = _overrides(arm, stand_ins)
    ok = check(DIR / f"{arm}.yaml", sets, world_size=1, device="cuda", files=True)
    assert "data_cache" not in yaml.safe_dump(ok.cfg.model_dump(mode="json"))


def test_budgets_equal_and_at_least_40M_positions_and_stated_in_the_readme():
    budgets = {a: _cfg(a).train.max_steps * _cfg(a).train.tokens_per_step for a in TRAINED}
    assert len(set(budgets.values())) == 1 and min(budgets.values()) >= 40_000_000, budgets
    readme = (DIR / "README.md").read_text()
    cfg = _cfg("long_only")
    assert f"{cfg.train.max_steps} steps x {cfg.train.tokens_per_step:,} tokens/step" in readme
    assert f"{budgets['long_only']:,}" in readme


def _diff(a: dict, b: dict, at="") -> set:
    if isinstance(a, dict) and isinstance(b, dict):
        return set().union(*(_diff(a.get(k), b.get(k), f"{at}.{k}".lstrip(".")) for k in set(a) | set(b)))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return set().union(set(), *(_diff(x, y, f"{at}[{i}]") for i, (x, y) in enumerate(zip(a, b))))
    return set() if a == b else {at}


def test_the_arms_differ_only_as_the_readme_says():
    lo, rc, ev, yu = (_dump(a) for a in ARMS)
    # recipe_evallike: the synthetic set's generator alone
    assert _diff(rc, ev) == {"name", "data.mix[2].path"}
    assert rc["data"]["mix"][2]["path"].endswith("synth_disjoint")
    assert ev["data"]["mix"][2]["path"].endswith("synth_evallike")
    # recipe vs long_only: the rope's apply, the data, the lr (the package), nothing else
    d = _diff(lo, rc)
    assert d - {"name", "rope.yarn.apply", "schedule.lr", "schedule.min_lr"} == {
        x for x in d if x.startswith("data.")
    }, d
    assert lo["rope"]["yarn"]["apply"] == "always" and rc["rope"]["yarn"]["apply"] == "beyond_original"
    # the untrained floor is long_only's config, evaluated (its own name only)
    assert _diff(lo, yu) == {"name"}
    # one evaluation for all
    assert lo["eval"] == rc["eval"] == ev["eval"] == yu["eval"]


VARS = {
    "K": "0",
    "ARM": "recipe",
    "a": "recipe",
    "TOKZ": "hf:data_cache/r4x/hf_tokenizer/tokenizer.json",
    "CK": "data_cache/r4x/runs/x/checkpoints/step_160",
    "REMAINING": "500",
}


def _commands(text: str, head: str) -> list[list[str]]:
    """Every command in the README's code blocks starting with `head`, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    out = []
    for ln in lines:
        ln = ln.split(" #", 1)[0].split(";", 1)[0].strip()
        if ln.startswith(head):
            ln = re.sub(r"\$\{?(\w+)\}?", lambda m: VARS[m.group(1)], ln.replace("$((1234 + K))", "1234"))
            out.append(shlex.split(ln))
    return out


def test_the_readme_commands_parse():
    """`megablu data synth`, `megablu eval`, `megablu config check` and `megablu data mix` as written in the
    README are accepted by megablu's argument parser (a misspelt flag fails here, not on the device)."""
    from megablu.cli import build_parser

    text = (DIR / "README.md").read_text()
    parser = build_parser()
    seen = set()
    for head in ("megablu data synth", "megablu eval", "megablu config check", "megablu data mix"):
        cmds = _commands(text, head)
        assert cmds, head
        for argv in cmds:
            args = parser.parse_args(argv[1:])
            seen.add(head)
            if head == "megablu data synth" and "--profile" in argv:
                assert args.profile == "disjoint" and args.filler_exclude.endswith("essays.txt.gz")
                assert (ROOT / args.filler_exclude).is_file()
    assert len(seen) == 4
    # each eval job's config, with its --set items and --tasks / --lengths, validates: the suite job is the
    # YAML's eval; the passkey/needle job has those two tasks alone, at L - max_new, no loss
    jobs = []
    for argv in _commands(text, "megablu eval"):
        args = parser.parse_args(argv[1:])
        sets = list(args.set) + ([f"eval.tasks=[{','.join(args.tasks)}]"] if args.tasks else [])
        jobs.append(load_config(ROOT / args.config, sets, world_size=1, device="cuda").eval)
    suite = [e for e in jobs if e.suite == "ruler"]
    pk = [e for e in jobs if e.suite is None]
    assert suite and pk and all(e.tasks == ["passkey", "needle"] for e in pk)
    assert all(e.lengths == [1024, 4072, 8168, 16360, 32744] and e.loss.data is None and not e.loss.sets for e in pk)
    assert all(e.lengths[-1] + e.max_new == 32768 for e in pk)
    # the training launch: its config with its --set items, for the world it launches
    (argv,) = _commands(text, "deepspeed")
    assert argv[1:3] == ["--num_gpus", "1"]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    cfg = load_config(ROOT / argv[argv.index("--config") + 1], sets, world_size=1, device="cuda")
    assert (cfg.name, cfg.data.seed, cfg.train.seed) == ("r4x_recipe_s0", 0, 1234)
    for arm in ARMS:
        assert f"`{arm}.yaml`" in text
