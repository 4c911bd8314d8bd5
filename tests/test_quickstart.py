"""The README's first command, end to end on CPU: data build, tiny pretrain (1 rank),
YaRN x2 extension from that parent with sp=2 on 2 ranks, summary on stdout."""
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_end_to_end(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "launch" / "quickstart.sh"), "--runs-dir", str(tmp_path / "runs")],
                       capture_output=True, text=True, cwd=ROOT, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("pretrain", "YaRN"))]
    assert len(lines) == 2, r.stdout
    runs = sorted((tmp_path / "runs").iterdir())
    parent = next(p for p in runs if p.name.startswith("tiny_cpu-"))
    ext = next(p for p in runs if p.name.startswith("tiny_cpu_ext-"))
    ps, es = json.loads((parent / "summary.json").read_text()), json.loads((ext / "summary.json").read_text())
    assert ps["steps"] == 40 and es["steps"] == 16
    assert ps["last_loss"] < ps["first_loss"] - 1.0          # it learned something real
    assert es["first_loss"] < ps["first_loss"] - 1.0         # the extension started from the parent's weights
    assert "sp 2" in es["world"]
    cfg = (ext / "config.resolved.yaml").read_text()
    assert "original_max_position: 256" in cfg and f"init_from: {parent}" in cfg
