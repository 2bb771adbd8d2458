"""``tspbench project-check --records``: measured run records (the lent H200's) projected with
their own model, layout and options, through the project API; bad input refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

from tspbench.cli import main
from tspbench.core.config import ModelConfig
from tspbench.projection.costcheck import check_records
from tspbench.projection.costmodel import load_preset, project
from tspbench.runtime.spec import RunSpec

H200 = Path(__file__).resolve().parents[2] / "results/reference/gpu-h200"


def test_each_record_is_projected_as_its_own_case():
    paths = sorted(str(p) for p in (H200 / "validate-torch_flash").glob("*.json"))
    preset = load_preset("h200")
    table = check_records(paths, preset)
    assert len(table) == 5 and set(table["mode"]) == {"train", "infer"}
    rec = json.loads(Path(paths[1]).read_text())  # 16K training, 4 layers of the 7B
    case = RunSpec.make("single", ModelConfig(**rec["model_config"]), seq_len=rec["seq_len"],
                        dtype="bf16", recompute="full")  # fmt: skip
    assert case.cfg.layers == 4
    row = table[table["seq_len"] == rec["seq_len"]].iloc[0]
    assert row["projected_s"] == project(case, preset)["step_time_s"]
    assert row["measured_s"] == rec["step_time_s"]


def test_bad_records_are_refused_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"status": "ok"}')
    assert main(["project-check", "--records", str(bad), "--hardware", "h200"]) == 2
    assert "record" in capsys.readouterr().err
    assert main(["project-check", "--records", str(bad)]) == 2  # no preset
    decode = str(H200 / "gpu-check/run-decode.json")  # nothing to project: decode only
    assert main(["project-check", "--records", decode, "--hardware", "h200"]) == 2
    assert "no ok training or forward record" in capsys.readouterr().err


def test_records_the_schema_passes_but_a_projection_cannot_use_are_refused(tmp_path, capsys):
    """model_config or recompute missing, a model field missing (it would be projected at a toy
    default) or unknown, a folder: one line each, exit 2, never a traceback."""
    rec = json.loads((H200 / "validate-torch_flash/val-train-S4096.json").read_text())
    cases = {
        "no-model": {k: v for k, v in rec.items() if k != "model_config"},
        "no-recompute": {k: v for k, v in rec.items() if k != "recompute"},
        "no-ffn": rec
        | {
            "model_config": {k: v for k, v in rec["model_config"].items() if k != "ffn"}
        },  # fmt: skip
        "extra": rec | {"model_config": rec["model_config"] | {"experts": 8}},
    }
    for name, bad in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(bad))
        assert main(["project-check", "--records", str(path), "--hardware", "h200"]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "record" in err and "Traceback" not in err, err
    assert main(["project-check", "--records", str(tmp_path), "--hardware", "h200"]) == 2
    assert "not a file" in capsys.readouterr().err
