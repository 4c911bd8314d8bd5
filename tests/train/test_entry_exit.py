"""How a rank leaves (megablu/train/entry.py): a rank whose run ended well leaves the process group
through utils.dist.finish(); if a peer is already gone, one line and exit 1, never a traceback."""

from megablu.train import entry
from megablu.utils import dist


def test_leave_is_0_when_the_group_closes_and_one_line_when_a_peer_is_gone(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(dist, "finish", lambda: calls.append(1))
    assert entry._leave(0) == 0 and calls == [1]
    assert capsys.readouterr().err == ""

    def gone():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1\nmore")

    monkeypatch.setattr(dist, "finish", gone)
    assert entry._leave(1) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("rank 1: finished its work, but leaving the process group failed (RuntimeError: ")
    assert "Connection closed by peer" in err


def test_finish_without_a_process_group_is_a_no_op():
    dist.finish()  # a world of one started as plain python: nothing to close, no error
