"""docs/CONFIG.md is generated from the schema's field descriptions (dev/gen_config_doc.py) and kept current:
a field added or a description changed without regenerating the page fails here."""

import importlib.util
from pathlib import Path

from megablu.config.schema import Config

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gen_config_doc", ROOT / "dev" / "gen_config_doc.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def test_config_doc_is_current():
    assert gen.main(["--check"]) == 0, "docs/CONFIG.md is stale: run python dev/gen_config_doc.py and commit it"


def test_config_doc_lists_every_section_and_field():
    text = (ROOT / "docs" / "CONFIG.md").read_text()
    for section in ("model", "rope", "rope.yarn", "data", "train", "memory", "eval", "eval.gate"):
        assert f"## `{section}`" in text, section
    for name in Config.model_fields["memory"].annotation.model_fields:
        assert f"| `{name}` |" in text, name


def test_a_changed_description_makes_the_page_stale(monkeypatch):
    field = Config.model_fields["memory"].annotation.model_fields["recompute"]
    monkeypatch.setattr(field, "description", (field.description or "") + " (changed)")
    assert "(changed)" in gen.render()
    assert gen.main(["--check"]) == 1
