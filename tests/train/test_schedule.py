import pytest

from megablu.config.schema import ScheduleConfig
from megablu.train.schedule import lr_at


def test_wsd_shape():
    s = ScheduleConfig(kind="wsd", lr=3e-4, min_lr=3e-5, warmup_steps=100, decay_start=3900)
    lrs = [lr_at(i, s, 4000) for i in range(4000)]
    assert lrs[0] == pytest.approx(3e-6) and lrs[99] == pytest.approx(3e-4)
    assert all(x == 3e-4 for x in lrs[100:3900])  # flat 3.0e-4 for steps 100-3899
    assert lrs[3999] == pytest.approx(3e-5)  # tail ends at min_lr
    assert all(a > b for a, b in zip(lrs[3900:], lrs[3901:]))  # strictly decaying tail


def test_cosine_shape_and_single_warmup():
    s = ScheduleConfig(kind="cosine", lr=1e-3, min_lr=0.0, warmup_steps=10)
    lrs = [lr_at(i, s, 110) for i in range(110)]
    assert lrs[9] == pytest.approx(1e-3)
    mid = 10 + 50 - 1
    assert lrs[mid] == pytest.approx(0.5e-3, rel=1e-9)
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)
    # one warmup: after it, the LR never rises again (no sawtooth on resume: lr_at is a
    # pure function of the global step)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
