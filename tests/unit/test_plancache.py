"""The plan's operation-count cache on disk (issue 35): read with type checks only, a negative
or swapped count changed the plan's answer silently. Now the file carries a checksum, and an
entry out of range is dropped (recounted)."""

import hashlib
import json

from tspbench.projection.plan import OpsCache


def _write(path, counts, checksum=None):
    text = json.dumps(counts, sort_keys=True).encode()
    path.write_text(
        json.dumps({"counts": counts, "sha256": checksum or hashlib.sha256(text).hexdigest()})
    )


def test_round_trip(tmp_path):
    cache = OpsCache(tmp_path, digest="d")
    cache.counts = {"a": [100, 180], "b": [7, 9]}
    cache._save()
    assert OpsCache(tmp_path, digest="d").counts == {"a": [100, 180], "b": [7, 9]}


def test_an_edited_file_counts_as_empty(tmp_path):
    path = tmp_path / "ops-d.json"
    _write(path, {"a": [100, 180]})
    doc = json.loads(path.read_text())
    doc["counts"]["a"] = [-100, 180]  # edited after it was written: the checksum says so
    path.write_text(json.dumps(doc))
    assert OpsCache(tmp_path, digest="d").counts == {}


def test_entries_out_of_range_are_dropped(tmp_path):
    counts = {"ok": [100, 180], "neg": [-5, 3], "swapped": [180, 100], "same": [5, 5],
              "bool": [True, 3], "float": [1.5, 3], "short": [4], "huge": [1, 10**9]}  # fmt: skip
    _write(tmp_path / "ops-d.json", counts)
    assert OpsCache(tmp_path, digest="d").counts == {"ok": [100, 180]}


def test_old_cut_and_foreign_files_count_as_empty(tmp_path):
    path = tmp_path / "ops-d.json"
    for text in ('{"a": [100, 180]}', '{"counts": {"a": [1, 2]', "[1, 2]", '{"counts": 5}'):
        path.write_text(text)
        assert OpsCache(tmp_path, digest="d").counts == {}, text
