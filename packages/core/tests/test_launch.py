"""The local launcher reports the rank that failed first, not the peers that broke after it."""

from __future__ import annotations

import json

from mega.core.launch import FAILURE_FILE_ENV, _first_recorded_failure, record_failure


def test_the_first_note_of_a_rank_wins(tmp_path, monkeypatch):
    path = tmp_path / "rank0.json"
    monkeypatch.setenv(FAILURE_FILE_ENV, str(path))
    record_failure(2)  # the clear error, noted where it was raised
    record_failure(1)  # the same process then exits non-zero
    assert json.loads(path.read_text())["exit_code"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.json"]


def test_the_earliest_failure_across_ranks_gives_the_exit_code(tmp_path):
    # Rank 1 stopped on bad input (2); rank 0's collective then broke (1), and may have exited first.
    (tmp_path / "rank0.json").write_text(json.dumps({"time": 1000.5, "exit_code": 1}))
    (tmp_path / "rank1.json").write_text(json.dumps({"time": 1000.2, "exit_code": 2}))
    paths = [str(tmp_path / f"rank{rank}.json") for rank in range(3)]  # rank 2 was stopped: no note
    assert _first_recorded_failure(paths) == 2
    assert _first_recorded_failure(paths[2:]) == 0


def test_outside_the_launcher_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(FAILURE_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    record_failure(2)
    assert list(tmp_path.iterdir()) == []
