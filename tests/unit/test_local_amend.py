"""The local launcher's amendment of rank 0's record: its own evidence of which rank died
beats rank 0's inference. CI saw a SIGKILLed rank 2 recorded as failed_ranks [1, 2, 3]: under
load ranks 1 and 3 had not yet posted why they stopped when rank 0 looked, so rank 0 called
them silent too."""

from tspbench.runtime.local import LocalRanks, amend

RANK0 = {"status": "error", "error_message": "rank 1, 2, 3 hung: ...", "failed_ranks": [1, 2, 3]}


def test_a_rank_killed_by_a_foreign_signal_is_the_failed_one():
    seen = LocalRanks(codes=[1, 1, -9, 1], killed_by_launcher=[], signal=None)
    rec = amend(RANK0, seen)
    assert rec["failed_ranks"] == [2]
    assert rec["rank_exit_codes"] == [1, 1, -9, 1]
    assert rec["error_message"].startswith("rank 2 killed by SIGKILL; rank 0 saw: rank 1, 2, 3")


def test_ranks_the_launcher_killed_itself_are_not_the_cause():
    seen = LocalRanks(codes=[1, -9, -9, -15], killed_by_launcher=[1, 2], signal=None)
    assert amend(RANK0, seen)["failed_ranks"] == [3]


def test_a_silent_rank_beats_a_signalled_one():
    seen = LocalRanks(codes=[1, -9, 1, -9], killed_by_launcher=[1], signal=None, silent={1: 31.0})
    assert amend(RANK0, seen)["failed_ranks"] == [1]


def test_nothing_seen_leaves_the_record_alone():
    seen = LocalRanks(codes=[1, 1, 1, 1], killed_by_launcher=[], signal=None)
    assert amend(RANK0, seen) is RANK0


def test_only_launcher_kills_keep_rank_0s_ranks_and_ok_records_keep_their_message():
    seen = LocalRanks(codes=[0, -9], killed_by_launcher=[1], signal=None)
    ok = {"status": "ok", "failed_ranks": []}
    rec = amend(ok, seen)
    assert rec["failed_ranks"] == [] and "error_message" not in rec
    assert rec["rank_exit_codes"] == [0, -9]
