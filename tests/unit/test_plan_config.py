"""The plan-map config (workflows/config/plan.yaml) against its schema: the schema's enums are
the code's registries, and a bad value is a one-line ConfigError naming it (through `snakemake
plan` and `tspbench plan-map`: tests/integration/test_pipeline_inputs.py)."""

from __future__ import annotations

import pytest

from tests.helpers.runner import ROOT
from tspbench.core.config import PRESETS, ConfigError
from tspbench.projection import costmodel
from tspbench.projection.plan import load_config
from tspbench.runtime.registry import schema, strategies

SCHEMA = schema("plan.schema.yaml")["properties"]
GOOD = "maps: [{model: 7b, hardware: mi300x}]\nseq_lens: [65536]\ngpus: [8]\n"


def test_schema_enums_are_the_registries():
    maps = SCHEMA["maps"]["items"]["properties"]
    assert maps["model"]["enum"] == list(PRESETS)
    assert maps["hardware"]["enum"] == list(costmodel.presets())
    assert SCHEMA["focus"]["enum"] == list(strategies())


def test_the_committed_config_passes_and_defaults_are_filled(tmp_path):
    cfg = load_config(ROOT / "workflows/config/plan.yaml")
    assert cfg["name"] == "plan" and cfg["focus"] == "tsp" and cfg["max_degree"] is None
    path = tmp_path / "p.yaml"
    path.write_text("maps: [{model: 7b, hardware: h100}]\nseq_lens: [64, 32]\ngpus: [16, 8]\n")
    cfg = load_config(path)
    defaults = (cfg["dtype"], cfg["mode"], cfg["max_batch"], cfg["focus"])
    assert defaults == ("bf16", "train", 16, "tsp")
    assert cfg["seq_lens"] == [32, 64] and cfg["gpus"] == [8, 16]


@pytest.mark.parametrize(
    "extra, needle",
    [
        ("name: '../x'\n", "name: '../x' does not match"),
        ("focus: 'tsp; touch PWNED'\n", "focus: 'tsp; touch PWNED' is not one of"),
        ("max_batch: 2.0\n", "max_batch: 2.0 is not of type 'integer'"),
        ("max_degree: .inf\n", "max_degree: inf is not a finite number"),
        ("dtype: fp16\n", "dtype: 'fp16' is not one of ['bf16', 'fp32']"),
        ("mode: decode\n", "mode: 'decode' is not one of"),
    ],
)
def test_a_bad_value_is_one_line_naming_it(tmp_path, extra, needle):
    path = tmp_path / "plan.yaml"
    path.write_text(GOOD + extra)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
