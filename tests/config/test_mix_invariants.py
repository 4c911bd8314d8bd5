"""data.mix spelling errors (check_invariants) and data problems found before any rank (preflight)."""

import os
import subprocess
import sys
from pathlib import Path

from megablu.config import ConfigError, config_warnings, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "configs" / "tiny_cpu.yaml"


def _src(name, weight, mode="pack", **kw):
    return (
        "{"
        + ", ".join(
            f"{k}: {v}" for k, v in {"name": name, "path": f"/d/{name}", "mode": mode, "weight": weight, **kw}.items()
        )
        + "}"
    )


def _mix(*srcs):
    return ["data.path=null", "data.mix=[" + ", ".join(srcs) + "]"]


def errors(sets):
    try:
        load_config(TINY, sets, world_size=1, device="cpu")
    except ConfigError as e:
        return e.errors
    return []


def test_a_valid_mixture_and_the_one_source_spelling():
    assert errors([]) == []
    assert errors(_mix(_src("long", 0.6), _src("short", 0.4, bucket="b0"))) == []


def test_path_with_mix_and_fields_without_effect():
    errs = errors(["data.mode=fit", "data.bucket=b2", "data.mix=[" + _src("a", 1) + "]"])
    assert len(errs) == 3, errs
    assert any(
        e.startswith("data.path='data_cache/stdlib' together with data.mix") and "remove data.path" in e for e in errs
    )
    assert any(e.startswith("data.mode='fit' has no effect with data.mix") and "data.mix[i].mode" in e for e in errs)
    assert any(e.startswith("data.bucket='b2' has no effect with data.mix") for e in errs)


def test_weights():
    (e,) = errors(_mix(_src("a", -0.5), _src("b", 1)))
    assert e.startswith("data.mix[0] (a).weight=-0.5: a weight is a share of loss tokens") and ">= 0" in e
    (e,) = errors(_mix(_src("a", 0), _src("b", 0.0)))
    assert e == ("data.mix weights [0.0, 0.0] sum to 0: nothing to sample; give at least one source a positive weight")
    (e,) = errors(_mix(_src("a", ".nan")))
    assert "weight=nan" in e
    (e,) = errors(["data.path=null", "data.mix=[]"])
    assert e.startswith("data.mix is empty")


def test_names_unique_and_required_fields():
    (e,) = errors(_mix(_src("a", 1), _src("a", 1)))
    assert e.startswith("data.mix[1].name='a' is also data.mix[0].name")
    errs = errors(["data.path=null", "data.mix=[{name: a, path: /d/a}]"])
    assert any(e.startswith("data.mix.0.mode: required") for e in errs)
    assert any(e.startswith("data.mix.0.weight: required") for e in errs)
    assert any(
        "unknown key" in e
        for e in errors(["data.path=null", "data.mix=[{name: a, path: /d/a, mode: pack, weight: 1, wieght: 2}]"])
    )


def test_doc_mask_needs_a_packed_source():
    (e,) = errors(["data.doc_mask=true"] + _mix(_src("a", 1, "fit"), _src("b", 1, "truncate"), _src("c", 0)))
    assert (
        e.startswith(
            "data.doc_mask=true but no source of data.mix with a positive weight is in mode pack "
            "(a=fit, b=truncate, c=pack)"
        )
        and "nothing to mask" in e
    )
    # a fit source beside packed ones: legal, and warned (its rows have nothing to mask)
    sets = ["data.doc_mask=true"] + _mix(_src("long", 1, "fit"), _src("short", 1), _src("unused", 0))
    assert errors(sets) == []
    w = config_warnings(load_config(TINY, sets, world_size=1, device="cpu"))
    assert any("data.mix[0] (long) is mode fit" in x and "nothing to mask" in x for x in w)
    assert any("data.mix[2] (unused) has weight 0" in x for x in w)
    (e,) = errors(["data.doc_mask=true", "data.mode=truncate"])  # the one-source spelling, as before
    assert e.startswith("data.doc_mask=true with data.mode=truncate")


def test_entry_refuses_a_bad_mixture_before_any_rank(tmp_path):
    """launch/ext32k.py: a source that is no dataset and a bucket the dataset lacks: exit 2, no run dir."""
    from tests.data.conftest import unique_docs, write_dataset

    write_dataset(tmp_path / "ds", unique_docs([30, 300]), ident="tiktoken_file:v4096:33b169a4741adc73")
    mix = (
        "data.mix=[{name: long, path: %s, bucket: b9, mode: pack, weight: 0.6}, "
        "{name: gone, path: %s, mode: fit, weight: 0.4}]" % (tmp_path / "ds", tmp_path / "nowhere")
    )
    env = {
        "WORLD_SIZE": "1",
        "RANK": "0",
        "PATH": "/usr/bin:/bin",  # this checkout's megablu, not an install
        "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    }
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "ext32k.py"),
            "--config",
            str(TINY),
            "--set",
            f"runs_dir={tmp_path}/runs",
            "--set",
            "data.path=null",
            "--set",
            mix,
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 2, r.stderr
    assert "data.mix[0] (long).bucket='b9': ['b9'] not in" in r.stderr
    assert f"data.mix[1] (gone).path: {tmp_path / 'nowhere'} is not a megablu dataset" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_config_hash_covers_the_mixture_only_when_set():
    """data.mix is left out of the hash while unset (runs started before the field existed still resume:
    checked by hand against main, tiny_cpu aa72e55785ecfbc7); a mixture, or another weight, is another
    run, so a resume across it is refused."""
    from megablu.config import config_hash

    def h(sets):
        return config_hash(load_config(TINY, sets, world_size=1, device="cpu"))

    a, b = h(_mix(_src("long", 0.6), _src("short", 0.4))), h(_mix(_src("long", 0.5), _src("short", 0.5)))
    assert len({h([]), a, b}) == 3
