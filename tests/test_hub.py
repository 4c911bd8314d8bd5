"""hub download/upload verification against a local stand-in of the repo (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megablu.cli import main
from megablu.hub import HubError, LocalRepo, RemoteFile, download, match_includes, verify_local


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    for rel, n in [
        ("cp_data_by_length/b3_16384_32768/train_shard_00000.bin", 100),
        ("cp_data_by_length/b3_16384_32768/train_shard_00001.bin", 101),
        ("cp_data_by_length/b3_16384_32768/val_shard_00000.bin", 50),
        ("cp_data_by_length/b2_8192_16384/val_shard_00000.bin", 40),
        ("README.md", 10),
    ]:
        (r / rel).parent.mkdir(parents=True, exist_ok=True)
        (r / rel).write_bytes(bytes(range(256))[: n % 256] * 1 + b"x" * (n - n % 256))
    return r


def test_match_rule_is_huggingface_hubs():
    files = [RemoteFile("a/b/c.bin", 1), RemoteFile("a/d.bin", 1), RemoteFile("e.txt", 1)]
    sel, un = match_includes(files, ["a/", "*.txt", "nothing/*"])
    assert sorted(sel) == ["a/b/c.bin", "a/d.bin", "e.txt"] and un == ["nothing/*"]
    sel, un = match_includes(files, ["A/*"])  # case-sensitive, like fnmatchcase
    assert sel == {} and un == ["A/*"]


def test_download_ok_prints_files(repo, tmp_path, capsys):
    rc = main(
        [
            "hub",
            "download",
            "org/data",
            "--repo-type",
            "dataset",
            "--from-local",
            str(repo),
            "--include",
            "cp_data_by_length/b3_16384_32768/train_shard_0000[0-1].bin",
            "--include",
            "cp_data_by_length/b2_8192_16384/val_shard_00000.bin",
            "--local-dir",
            str(tmp_path / "dl"),
        ]
    )
    out = capsys.readouterr().out.split()
    assert rc == 0 and len(out) == 3
    for p in out:
        rel = Path(p).relative_to(tmp_path / "dl")
        assert Path(p).read_bytes() == (repo / rel).read_bytes()


def test_pattern_matching_nothing_is_exit_2_and_downloads_nothing(repo, tmp_path, capsys):
    # the seed's trap: a typo'd include "succeeded" having matched nothing
    rc = main(
        [
            "hub",
            "download",
            "org/data",
            "--repo-type",
            "dataset",
            "--from-local",
            str(repo),
            "--include",
            "cp_data_by_length/b3_16384_32768/val_shard_00000.bin",
            "--include",
            "cp_data_by_length/b3_16384_32768/train_shard_0000[4-7].bin",
            "--local-dir",
            str(tmp_path / "dl"),
        ]
    )
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    assert "matched no file" in cap.err and "train_shard_0000[4-7].bin" in cap.err
    assert not (tmp_path / "dl").exists() or not any((tmp_path / "dl").rglob("*.bin"))


class _FaultyRepo(LocalRepo):
    def __init__(self, root, mode):
        super().__init__(root)
        self.mode = mode

    def fetch(self, path, local_dir):
        if self.mode == "skip" and path.endswith("00001.bin"):
            return  # the transfer "succeeded" without the file
        super().fetch(path, local_dir)
        if self.mode == "short" and path.endswith("00001.bin"):
            p = local_dir / path
            p.write_bytes(p.read_bytes()[:-7])  # connection dropped mid-file


@pytest.mark.parametrize("mode,needle", [("skip", "missing cp_data"), ("short", "94 bytes, repo lists 101")])
def test_missing_or_short_file_after_download_is_an_error(repo, tmp_path, mode, needle):
    with pytest.raises(HubError, match="download incomplete") as e:
        download(_FaultyRepo(repo, mode), ["cp_data_by_length/b3_16384_32768/*.bin"], tmp_path / "dl")
    assert needle in str(e.value)


def test_checksum_is_checked_when_the_listing_has_one(repo, tmp_path):
    class ShaRepo(LocalRepo):
        def list_files(self):
            return [RemoteFile(f.path, f.size, "0" * 64) if f.path == "README.md" else f for f in super().list_files()]

    with pytest.raises(HubError, match="checksum README.md"):
        download(ShaRepo(repo), ["README.md"], tmp_path / "dl")
    assert verify_local(tmp_path / "dl", {"README.md": RemoteFile("README.md", 10)}) == []


def test_no_include_is_refused(repo, tmp_path):
    with pytest.raises(HubError, match="include"):
        download(LocalRepo(repo), [], tmp_path / "dl")


def test_model_card_shows_the_harness_eval_results(tmp_path):
    """The card's eval table is built from the run's real eval/step_<N>.json (megablu.eval/1):
    arm x length accuracies per evaluated step, not the files' metadata."""
    from megablu.config.schema import EvalConfig
    from megablu.eval.report import make_result, write_artifacts, write_result
    from megablu.hub import model_card

    run = tmp_path / "ext-0001"
    for step, acc in ((2, {1024: 100.0, 4096: 50.0}), (4, {1024: 100.0, 4096: 75.0})):
        cells = [
            {
                "task": "passkey",
                "length": L,
                "n": 4,
                "correct": round(a * 4 / 100),
                "acc_pp": a,
                "ci_pp": [0.0, 100.0],
                "digest": "d",
            }
            for L, a in acc.items()
        ]
        res = make_result(
            cells,
            [{"task": "passkey"}],
            arm=run.name,
            step=step,
            window=8192,
            eval_cfg=EvalConfig(lengths=list(acc)),
            tokenizer_identity="t",
            sp=1,
        )
        write_result(res, run / "eval" / f"step_{step}.json")
        write_artifacts(res, run / "eval", step, plot=False)
    card = model_card(run, {"run_id": run.name, "step": 4}, {"architectures": ["LlamaForCausalLM"]})
    assert "| arm | 1024 | 4096 | pp/doubling [95%] | eff. length |" in card
    # only the uploaded step's weights were evaluated by the row shown; step 2's result is named, not shown
    assert "| ext-0001@4 | 100.0 | 75.0 |" in card and "| ext-0001@2 |" not in card
    assert "Evaluated at other steps, not shown (other weights): 2." in card
    assert "created_utc" not in card and "no eval results" not in card


def test_hf_failures_become_hub_errors(monkeypatch, tmp_path):
    """A network/auth failure inside huggingface_hub is a HubError naming the call (CLI exit 2),
    not a traceback; no network is touched (the API methods are replaced)."""
    import huggingface_hub

    from megablu.hub import HfRepo, HubError

    def offline(*a, **k):
        raise ConnectionError("Max retries exceeded with url: /api/models/org/m")

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_tree", offline)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    repo = HfRepo("org/m")
    with pytest.raises(HubError, match="listing model repo org/m: ConnectionError: .?Max retries"):
        repo.list_files()
    with pytest.raises(HubError, match="downloading a.bin from org/m"):
        repo.fetch("a.bin", tmp_path)
