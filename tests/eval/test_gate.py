"""The short-context gate on synthetic results: the seed's cache bug (16k up, 4k collapsed) fails
even though long context improved; a within-margin drop passes; an unchecked length fails."""

from megablu.config.schema import GateConfig
from megablu.eval.gate import check_gate


def result(arm, acc_by_len, n=100, task="passkey"):
    return {
        "arm": arm,
        "step": 0,
        "cells": [
            {"task": task, "length": L, "n": n, "correct": round(a * n / 100), "acc_pp": a, "digest": "x"}
            for L, a in acc_by_len.items()
        ],
    }


PARENT = result("l2", {1024: 90.0, 4096: 74.0, 16360: 0.0})
GATE = GateConfig(short_lengths=[1024, 4096], margin_pp=5.0)


def test_cache_bug_fails_despite_long_context_gain():
    bug = result("bug", {1024: 88.0, 4096: 16.0, 16360: 15.0})
    g = check_gate(bug, PARENT, GATE)
    assert not g.passed
    assert "SHORT-CONTEXT GATE FAILED" in g.message and "passkey@4096: 16.0% vs parent 74.0%" in g.message
    assert "drop 58.0 pp > margin 5 pp" in g.message and "passkey@16360 +15.0 pp" in g.message
    assert [c["passed"] for c in g.checks] == [True, False]


def test_within_margin_passes_and_margin_is_inclusive():
    ok = result("ok", {1024: 85.0, 4096: 72.0, 16360: 30.0})  # drops 5.0 and 2.0 pp
    g = check_gate(ok, PARENT, GATE)
    assert g.passed and "passed" in g.message
    assert not check_gate(result("x", {1024: 84.0, 4096: 74.0}), PARENT, GATE).passed  # 6 pp > 5


def test_unchecked_short_length_fails():
    g = check_gate(result("x", {4096: 80.0, 16360: 40.0}), PARENT, GATE)
    assert not g.passed and "cannot check passkey@1024 (arm has no result)" in g.message
    g = check_gate(result("x", {1024: 95.0, 4096: 80.0}, task="needle"), PARENT, GATE)
    assert not g.passed and "cannot check any task" in g.message


def test_parent_problems_predicts_an_unchecked_gate():
    """parent_problems (asked before hours of generation) names exactly what check_gate would
    fail as unchecked: the seed's l2 arm was evaluated at 4096/8192/16360 only, so it cannot
    gate the 32k extension's 1024 check."""
    from megablu.eval.gate import parent_problems

    perfect = result("arm", {1024: 100.0, 4096: 100.0})
    assert parent_problems(PARENT, GATE, ["passkey"]) == [] and check_gate(perfect, PARENT, GATE).passed
    l2 = result("l2", {4096: 80.0, 8192: 62.0, 16360: 35.0})
    (msg,) = parent_problems(l2, GATE, ["passkey"])
    assert "l2@0 has no result for passkey@1024 (it has passkey@4096, passkey@8192, passkey@16360)" in msg
    assert not check_gate(perfect, l2, GATE).passed
    (msg,) = parent_problems(l2, GATE, ["needle"])
    assert "no result for any of the tasks ['needle']" in msg
    assert parent_problems(l2, GateConfig(short_lengths=[4096]), ["passkey", "needle"]) == []
