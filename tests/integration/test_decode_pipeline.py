"""The default config's decode cells in the real pipeline: the dry run lists every one of them
as a run job with its decode arguments, and one of them runs end to end through the run rule
(a scratch copy of the workflow), writing a record with the decode fields."""

from __future__ import annotations

import json
import re

import yaml

from tests.helpers.runner import ROOT, copy_workflow
from tests.helpers.runner import snakemake as smk
from tspbench.core.config import get_config
from tspbench.runtime.spec import RunSpec

DEFAULT = yaml.safe_load((ROOT / "workflows/config/default.yaml").read_text())


def test_default_decode_cells_are_listed_and_one_runs_end_to_end(tmp_path):
    from tspbench.pipeline.cells import sweep_cells

    copy_workflow(tmp_path)
    p = smk("-n", "-p", "--cores", "2", cwd=tmp_path)  # the embedded default config
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    out = p.stdout + p.stderr
    jobs = re.findall(r"rule run:\n.*?wildcards: cell=(\S+)", out, re.S)
    expected = {c.id for c in sweep_cells(DEFAULT)[0] if c.spec.decoding}
    assert len(expected) == 12 and {j for j in jobs if ".decode." in j} == expected
    assert "--mode decode --new-tokens 8" in out

    cell = "tsp.D2.g2.S256.B1.decode.N8"
    p = smk(f"results/default/runs/{cell}.json", "--cores", "2", cwd=tmp_path, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    rec = json.loads((tmp_path / f"results/default/runs/{cell}.json").read_text())
    assert rec["status"] == "ok", rec.get("error_message")
    spec = RunSpec.make("tsp", get_config("tiny", ffn=256), degree=2, seq_len=256,
                        mode="decode", new_tokens=8)  # fmt: skip
    assert rec["kv_cache_bytes"] == spec.impl.decoder.kv_cache_bytes(spec)
    assert len(rec["generated_tokens"]) == 1 and len(rec["generated_tokens"][0]) == 8
    assert rec["decode_latency_p90_s"] >= rec["decode_latency_s"] > 0
