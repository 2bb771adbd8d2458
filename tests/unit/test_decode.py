"""Decode without processes (docs/decode.md): bad combinations exit 2 with one line, the spec
carries new_tokens, the closed forms of bytes and cache size are docs/decode.md's formulas, the
cache grows balanced, split-K attention equals softmax attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.checks import argv_spec
from tspbench.core.config import ConfigError, get_config
from tspbench.core.decode import bytes_per_step
from tspbench.core.kvcache import KVCache, partial_attention
from tspbench.runtime.spec import RunSpec

DEC = ["--mode", "decode", "--prompt-len", "32"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--strategy", "fsdp_cp", "--degree", "2", *DEC], "mode='decode': strategy fsdp_cp has"),
        (["--strategy", "dp", "--degree", "2", *DEC], "strategies that decode: tsp, tp, tpsp, sp"),
        (["--strategy", "tsp", "--degree", "4", "--mode", "generate", "--prompt-len", "30"],
         "seq_len=30: must be divisible by 2*D=8"),
        (["--strategy", "tpsp", "--tp", "2", "--sp", "2", "--mode", "decode", "--prompt-len", "6"],
         "seq_len=6: must be divisible by 2*D=4"),
        (["--strategy", "tsp", "--seq-len", "32", "--new-tokens", "4"],
         "new_tokens=4: only --mode decode or generate"),
        (["--strategy", "tsp", *DEC, "--new-tokens", "1"], "--new-tokens: '1': must be between 2"),
        (["--strategy", "sp", "--degree", "2", "--dp", "2", *DEC], "dp=2: decode runs one model"),
        (["--strategy", "tp", "--degree", "4", *DEC, "--set", "heads=12", "--set", "hidden=96",
          "--set", "kv_heads=6"], "model.kv_heads=6: must divide or be divisible by T=4"),
        (["--strategy", "tsp", "--degree", "4", *DEC, "--set", "kv_heads=2"],
         "model.kv_heads=2: must be divisible by D"),
    ],
)  # fmt: skip
def test_bad_decode_arguments_exit_2_with_one_line(tmp_path, capsys, monkeypatch, args, needle):
    from tspbench.cli import main

    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "bad.json"
    try:
        code = main(["run", *args, "--out", str(out)])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2
    assert len(lines) == 1 and needle in lines[0], lines
    assert not out.exists()


def test_the_spec_carries_new_tokens():
    spec = argv_spec(["--strategy", "tp", "--degree", "4", *DEC, "--set", "kv_heads=2"])
    assert spec.new_tokens == 16 and spec.decoding  # the default; kv_heads < T: replicated
    assert argv_spec(spec.to_argv()) == spec
    assert spec.id.endswith(".decode.N16")
    assert spec.header("local", 4)["new_tokens"] == 16
    assert "new_tokens" not in argv_spec(["--strategy", "tp", "--seq-len", "32"]).header("local", 1)
    with pytest.raises(ConfigError, match="kv_heads=2: must be divisible by T"):
        spec.replace(mode="infer", new_tokens=0)  # training layouts still split KV heads


def _spec(strategy: str, model: str, dtype: str, B: int, **lay) -> RunSpec:
    cfg = get_config(model)
    return RunSpec.make(strategy, cfg, seq_len=1024, batch=B, mode="decode", new_tokens=9,
                        dtype=dtype, **lay)  # fmt: skip


def closed_form(spec: RunSpec) -> float:
    """docs/decode.md section 3, written out."""
    c, B, e = spec.cfg, spec.batch, spec.e
    h, kv, nh, L = c.hidden, c.kv_dim, c.heads, c.layers
    D, T, S = spec.degree, spec.tp, spec.sp
    q = (D - 1) / D
    return {
        "single": 0,
        "tp": 2 * q * (2 * L + 1) * B * h * e + 8 * B * (D - 1),
        "sp": L * 8 * q * B * (h + 2 * nh),
        "tpsp": 2 * (T - 1) / T * (2 * L + 1) * B * h * e
        + L * 8 * (S - 1) / S * B * (h + 2 * nh) / T
        + 8 * B * (T - 1),
        "tsp": 2 * q * B * h * e + L * q * B * ((5 * h + 2 * kv) * e + 4 * h + 12 * nh)
        + 8 * B * (D - 1),
    }[spec.strategy]  # fmt: skip


LAYS = [
    ("single", {}), ("tp", {"degree": 8}), ("sp", {"degree": 8}), ("tsp", {"degree": 8}),
    ("tsp", {"degree": 2}), ("tpsp", {"tp": 4, "sp": 2}), ("tpsp", {"tp": 2, "sp": 4}),
]  # fmt: skip


@pytest.mark.parametrize("strategy, lay", LAYS, ids=lambda x: str(x))
@pytest.mark.parametrize("model, dtype, B", [("7b", "bf16", 1), ("7b", "bf16", 16),
                                              ("llama3-8b", "fp32", 4)])  # fmt: skip
def test_decode_bytes_are_the_documented_closed_form(strategy, lay, model, dtype, B):
    spec = _spec(strategy, model, dtype, B, **lay)
    got = sum(bytes_per_step(spec.impl.decoder.schedule(spec)).values())
    assert got == pytest.approx(closed_form(spec), rel=1e-12)


def test_the_documented_7b_example():
    """docs/decode.md section 3: 7B, bf16, B = 1, D = 8."""

    def mb(s: str) -> float:
        spec = _spec(s, "7b", "bf16", 1, degree=8)
        return round(sum(bytes_per_step(spec.impl.decoder.schedule(spec)).values()) / 1e6, 2)

    assert (mb("tp"), mb("tsp"), mb("sp")) == (0.93, 2.09, 0.93)


@pytest.mark.parametrize("strategy, lay", LAYS, ids=lambda x: str(x))
def test_kv_cache_bytes_closed_form(strategy, lay):
    spec = _spec(strategy, "llama3-8b", "bf16", 2, **lay)  # 8 KV heads, P = 1024, N = 9
    c = spec.cfg
    per_token_head = 2 * c.layers * 2 * c.d_head * 2  # K and V, B = 2, bf16
    seq, heads = {"single": (1, 8), "tp": (1, 1), "sp": (8, 8), "tsp": (lay.get("degree"), 8),
                  "tpsp": (lay.get("sp"), 8 // lay.get("tp", 1))}[strategy]  # fmt: skip
    slots = 1024 // seq + math.ceil(8 / seq)
    assert spec.impl.decoder.kv_cache_bytes(spec) == per_token_head * slots * heads


def test_the_cache_grows_round_robin_balanced():
    caches = [KVCache.empty(1, 1, 1, KVCache.capacity(16, 16 + 11, 4), 2, torch.zeros(1), 4, r)
              for r in range(4)]  # fmt: skip
    for c in caches:
        c.start(4, 16)
    for _ in range(11):
        for c in caches:
            if c.mine:
                c.write(0, torch.ones(1, 1, 2), torch.ones(1, 1, 2))
            c.advance()
    assert [c.length for c in caches] == [7, 7, 7, 6]  # positions 16..26 to ranks pos mod 4
    with pytest.raises(ConfigError, match="allocated for 7"):
        caches[0].write(0, torch.ones(1, 1, 2), torch.ones(1, 1, 2))  # past its capacity


def test_split_k_attention_merges_to_softmax_attention():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, generator=g)
    k, v = torch.randn(2, 2, 20, 16, generator=g), torch.randn(2, 2, 20, 16, generator=g)
    full = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    parts = [partial_attention(q, k[:, :, s], v[:, :, s]) for s in (slice(0, 7), slice(7, 20))]
    parts.append(partial_attention(q, k[:, :, :0], v[:, :, :0]))  # an empty slice
    assert parts[-1][1].isneginf().all() and not parts[-1][0].any()
    lse = torch.stack([p[1] for p in parts])
    w = (lse - lse.amax(0)).exp()
    o = sum(wi[..., None] * p[0] for wi, p in zip(w, parts)) / w.sum(0)[..., None]
    torch.testing.assert_close(o, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(partial_attention(q, k, v)[0], full, rtol=1e-5, atol=1e-6)
