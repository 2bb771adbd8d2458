"""The projected throughput tables run TSP as ``tspbench project`` does: with the preset's MLP
schedule (broadcast on MI300X, ring on H100), one strategy label on every preset, and the
schedule in its own column. (They once ran TSP's ring everywhere: 1.25 s for the 7B 16K step
on MI300X where ``tspbench project`` says 0.540 s.)"""

from __future__ import annotations

import pytest

from tests.helpers.runner import ROOT
from tspbench.core.config import get_config
from tspbench.pipeline.projected import load, throughput_tables
from tspbench.projection import costmodel
from tspbench.runtime.spec import RunSpec


@pytest.fixture
def flat_ops(monkeypatch):
    """Operations per step charged alike for every spec (counting them takes seconds)."""
    monkeypatch.setattr(costmodel, "count_ops", lambda c: 10_000)


def test_tsp_rows_take_each_presets_mlp_schedule(flat_ops):
    cfg = load(str(ROOT / "workflows/config/projected.yaml"))
    cfg["hardware"] = ["mi300x", "h100"]
    cfg["throughput"] |= {"strategies": ["tsp", "tp"], "seq_lens": [16384], "gpus": [8],
                          "scaling_seq_lens": [16384], "batches": [1]}  # fmt: skip
    for name, df in throughput_tables(cfg).items():
        tsp = df[df.strategy == "tsp"]
        assert dict(zip(tsp.hardware, tsp.mlp_schedule)) == {"mi300x": "broadcast", "h100": "ring"}
        assert df[df.strategy == "tp"].mlp_schedule.isna().all(), name
    row = throughput_tables(cfg)["throughput_vs_seq"].query(
        "hardware == 'mi300x' and strategy == 'tsp' and mode == 'train'"
    )
    spec = RunSpec.make("tsp", get_config("7b"), degree=8, seq_len=16384, dtype="bf16",
                        recompute="full")  # fmt: skip
    preset = costmodel.load_preset("mi300x")
    projected = costmodel.project(spec.preset_options(preset), preset)
    assert row.step_time_s.item() == projected["step_time_s"]


def test_a_combination_of_listed_option_values_that_no_run_takes_is_refused_at_load(tmp_path):
    """Each listed value may be valid alone and a combination not (TSP's kv_backward=save with
    the K/V ring): ``load`` says so in one line, before the estimate rule or the report runs."""
    import yaml

    from tspbench.core.config import ConfigError

    cfg = yaml.safe_load((ROOT / "workflows/config/projected.yaml").read_text())
    cfg["throughput"]["options"] = {"kv_exchange": ["all_gather", "ring"], "kv_backward": ["save"]}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="kv_backward=save: needs kv_exchange=all_gather"):
        load(str(path))
