"""dev/lme_wheels.py: which of the carried lm-eval wheels go onto the device image."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("lme_wheels", ROOT / "dev" / "lme_wheels.py")
lme_wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lme_wheels)


def test_pure_wheels_always_go_compiled_ones_only_where_the_image_lacks_them():
    names = [
        "datasets-5.2.0-py3-none-any.whl",  # pure, the image holds it: ours (CI's pin) goes
        "word2number-1.1-py3-none-any.whl",  # pure, missing
        "multiprocess-0.70.19-py312-none-any.whl",  # pure for one python
        "pandas-3.1.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",  # compiled, held: kept
        "xxhash-4.1.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",  # compiled, missing
    ]
    image = {"datasets", "pandas"}
    chosen, kept = lme_wheels.choose([Path(n) for n in names], held=lambda d: d in image)
    assert sorted(p.name.split("-")[0] for p in chosen) == ["datasets", "multiprocess", "word2number", "xxhash"]
    assert kept == ["pandas"]


def test_the_block_is_lm_evals_less_pyarrow():
    block = lme_wheels._block()
    assert block[0].startswith("lm-eval==")
    assert not any(r.startswith("pyarrow") for r in block)
    assert any(r.startswith("pandas==") for r in block)
