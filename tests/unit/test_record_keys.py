"""The record's key list (tspbench.runtime.record_keys) against what shares it: the schema names
exactly its keys and requires only keys that are written when it requires them, the header and
the summaries write theirs in the list's order, and the aggregate reads record keys."""

from __future__ import annotations

import pytest

from tests.helpers.records import header_keys
from tspbench.core.config import get_config
from tspbench.pipeline import aggregate
from tspbench.runtime import record_keys as rk
from tspbench.runtime.registry import all_options, schema
from tspbench.runtime.spec import RunSpec

SCHEMA = schema("record.schema.json")


def every_key() -> set[str]:
    """Every key some record carries: the lists, and the strategies' options."""
    groups = (rk.INPUTS, all_options(), rk.SETUP, rk.PLACEMENT, rk.PROVENANCE, rk.OUTCOME)
    summaries = (*rk.RUN_SUMMARY, *rk.DECODE_SUMMARY, *rk.PIPELINE_SUMMARY, *rk.MOE_SUMMARY)
    return {*(k for g in groups for k in g), *summaries, *rk.CLOSING}


def test_the_schema_names_exactly_the_record_keys():
    """A key written but not in the schema would go unchecked (the schema allows any other
    property); one in the schema but never written documents nothing."""
    props, keys = set(SCHEMA["properties"]), every_key()
    assert sorted(props - keys) == [], "in the schema, not in tspbench.runtime.record_keys"
    assert sorted(keys - props) == [], "in tspbench.runtime.record_keys, not in the schema"


def test_the_schema_requires_only_keys_written_when_it_requires_them():
    every_record = {*rk.INPUTS, "status", *rk.CLOSING} - {"new_tokens", *rk.PIPELINE}
    assert set(SCHEMA["required"]) <= every_record
    every_ok = {*rk.PROVENANCE, *(set(rk.RUN_SUMMARY) & set(rk.DECODE_SUMMARY))}
    assert set(SCHEMA["then"]["required"]) <= every_ok
    assert set(SCHEMA["else"]["required"]) <= set(rk.OUTCOME)
    assert set(SCHEMA["dependentSchemas"]["new_tokens"]["then"]["required"]) <= set(rk.DECODE)
    assert SCHEMA["allOf"][0]["then"]["required"] == ["new_tokens"]


@pytest.mark.parametrize("mode", ["train", "infer", "decode", "generate"])
def test_the_header_writes_the_inputs_in_order(mode):
    new_tokens = 5 if mode in ("decode", "generate") else 0
    spec = RunSpec.make(
        "tp", get_config("tiny"), degree=2, seq_len=16, batch=2, mode=mode, new_tokens=new_tokens
    )
    assert list(spec.header("local", 2)) == header_keys(mode)


def test_a_summary_writes_its_list_exactly_in_its_order():
    assert list(rk.ordered(("a", "b"), {"b": 1, "a": 2})) == ["a", "b"]
    with pytest.raises(KeyError, match=r"\['c'\] not listed"):
        rk.ordered(("a",), {"a": 1, "c": 2})
    with pytest.raises(KeyError, match=r"\['b'\] not given"):
        rk.ordered(("a", "b"), {"a": 1})


def test_the_aggregate_reads_record_keys():
    assert set(aggregate.MATCH_KEYS) <= set(rk.INPUTS)  # compared with the cell's own header
    assert sorted({*aggregate.SCALARS, *aggregate.EXPERTS, *aggregate.DECODE} - every_key()) == []


def test_the_schema_takes_every_attention_kernel_and_the_gpu_records():
    """The kernels a record may name are the entry point's (a new one failed the H200's records
    until the schema named it), and every record the lent H200 wrote passes the schema."""
    from pathlib import Path

    from tspbench.core.attention import BACKENDS
    from tspbench.runtime.record import check_record

    assert SCHEMA["properties"]["attention_backend"]["enum"] == list(BACKENDS)
    root = Path(__file__).resolve().parents[2] / "results/reference/gpu-h200"
    records = sorted(root.glob("validate-*/*.json")) + sorted(root.glob("gpu-check/run-*.json"))
    assert len(records) == 13
    for path in records:
        assert check_record(str(path))["status"] == "ok", path
