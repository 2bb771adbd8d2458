"""Single-process tests of the shared core: configs, zigzag, attention kernels, counting, memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tspbench.core import memory, zigzag
from tspbench.core.attention import attention, causal_fwd
from tspbench.core.comm import bus_bytes
from tspbench.core.config import PRESETS, ConfigError, get_config, parse_overrides
from tspbench.core.memory import MemoryTracker, TrackedOOM
from tspbench.core.strategy import Layout
from tspbench.runtime import registry
from tspbench.runtime.registry import get_strategy, strategies


def test_presets_and_overrides():
    c = PRESETS["7b"]
    assert (c.hidden, c.layers, c.heads, c.kv_heads, c.ffn, c.vocab) == (
        4096,
        32,
        32,
        32,
        16384,
        32000,
    )
    assert 8.5e9 < c.n_params(embeddings=False) < 8.7e9  # "about 8.6B without embeddings"
    g = get_config("tiny", **parse_overrides(["kv_heads=4", "rope_theta=500000"]))
    assert g.kv_heads == 4 and g.rope_theta == 500000.0 and g.kv_dim == 4 * g.d_head


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda: get_config("huge"), "model='huge': unknown preset"),
        (lambda: parse_overrides(["nope=1"]), "'nope': unknown model field"),
        (lambda: parse_overrides(["heads=x"]), "heads='x': must be an integer"),
        (lambda: get_config("tiny", heads=7), "model.hidden=64: must be divisible by model.heads"),
        (lambda: get_config("tiny", kv_heads=3), "model.kv_heads=3: must divide model.heads=8"),
        (lambda: zigzag.check_divisible(30, 4), "seq_len=30: must be divisible by 2*D=8"),
    ],
)
def test_config_errors_name_value_and_rule(call, needle):
    with pytest.raises(ConfigError, match=None) as e:
        call()
    assert needle in str(e.value)


def test_zigzag_roundtrip_and_balance():
    S, D = 48, 3
    x = torch.arange(S)[None, :]
    shards = [zigzag.shard(x, D, r) for r in range(D)]
    assert torch.equal(zigzag.unshard(shards), x)
    assert zigzag.positions(S, D, 0).tolist() == list(range(8)) + list(range(40, 48))
    # causal work (keys seen) is equal on every rank
    work = [int((zigzag.positions(S, D, r) + 1).sum()) for r in range(D)]
    assert len(set(work)) == 1
    cat = torch.cat(shards, dim=1)
    assert torch.equal(cat.index_select(1, zigzag.gathered_to_global(S, D)), x)
    assert torch.equal(x.index_select(1, zigzag.global_to_gathered(S, D)), cat)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("D", [1, 2, 3, 4])
def test_zigzag_attention_equals_sdpa(dtype, tol, D):
    """Forward and backward of the kernel composite equal full causal SDPA (GQA: 8 q, 4 kv)."""
    torch.manual_seed(D)
    B, S, d = 2, 48, 16
    q = torch.randn(B, 8, S, d, dtype=dtype, requires_grad=True)
    k = torch.randn(B, 4, S, d, dtype=dtype, requires_grad=True)
    v = torch.randn(B, 4, S, d, dtype=dtype, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    do = torch.randn_like(ref)
    ref.backward(do)
    outs, dq = [], torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(D):
        ql = zigzag.shard(q.detach(), D, r, dim=2).requires_grad_()
        kk, vv = k.detach().requires_grad_(), v.detach().requires_grad_()
        o = attention(ql, kk, vv, r, D)
        o.backward(zigzag.shard(do, D, r, dim=2))
        outs.append(o.detach())
        dq[:, :, zigzag.positions(S, D, r)] += ql.grad
        dk += kk.grad
        dv += vv.grad
    pairs = [(zigzag.unshard(outs, dim=2), ref.detach()), (dq, q.grad), (dk, k.grad), (dv, v.grad)]
    for a, b in pairs:
        assert float((a - b).abs().max() / b.abs().max()) < tol


def test_lower_right_mask_geometry():
    """A query block at the end of a longer key range sees the prefix unmasked."""
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    from torch.nn.attention.bias import causal_lower_right

    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(4, 12))
    out, lse = causal_fwd(q, k, v)
    assert torch.allclose(out, ref, atol=1e-6) and lse.shape == (1, 2, 4)


def test_bus_bytes_conventions():
    assert bus_bytes("all_gather", 800, 4) == 600
    assert bus_bytes("reduce_scatter", 800, 4) == 600
    assert bus_bytes("all_reduce", 800, 4) == 1200
    assert bus_bytes("broadcast", 800, 4) == 600
    assert bus_bytes("reduce", 800, 4) == 600
    assert bus_bytes("send_recv", 800, 4) == 800
    assert bus_bytes("all_reduce", 800, 1) == 0


def test_memory_tracker_counts_storages_and_enforces_budget():
    m = MemoryTracker()
    with m:
        a = torch.zeros(1000)
        view = a[:10]
        b = a * 2
        assert m.live == 8000
        del b
    assert m.live == 4000 and m.peak == 8000
    del a, view
    assert m.live == 0
    with pytest.raises(TrackedOOM), MemoryTracker(limit=10_000):
        _ = [torch.zeros(1000) for _ in range(3)]


def test_memory_tracker_keeps_the_peak_without_staging_beside_the_peak():
    """A staging buffer (``charge``) at the crest moves ``peak`` but not ``peak_unstaged``,
    which is the high-water mark of the tensors alone (NCCL's peak of the same ops)."""
    m = MemoryTracker()
    with m:
        a = torch.zeros(1000)  # 4000 bytes
        release = memory.charge(3000)  # staged while a is live: 7000 with staging
        release()
        b = torch.zeros(1500)  # 4000 + 6000: the tensors' own crest, nothing staged
        del b
    assert (m.peak, m.peak_unstaged) == (10_000, 10_000)
    with m:
        m.reset_peak()
        release = memory.charge(8000)  # 12000 with staging, the tensors still 4000
        release()
    assert (m.peak, m.peak_unstaged, m.live, m.staged) == (12_000, 4000, 4000, 0)
    del a


def test_memory_tracker_follows_storage_resizes():
    """FSDP2 frees a gathered parameter by resizing its storage to 0 and re-allocates it the same
    way, which no dispatch mode sees: the tracker counts the storage at its current size (and
    stops watching resizes when no tracker is entered)."""
    m = MemoryTracker()
    with m:
        a = torch.zeros(1000)
        a.untyped_storage().resize_(0)
        assert m.live == 0
        a.untyped_storage().resize_(2000)  # 500 floats
        assert m.live == 2000 and m.peak == 4000
        b = torch.zeros(2000)
        assert m.peak == 10000
        del b
    assert torch.UntypedStorage.resize_ is memory._resize  # torch's own again
    a.untyped_storage().resize_(0)  # outside the tracker: not reported
    assert m.live == 2000
    del a
    assert m.live == 0
    freed = torch.zeros(100)
    freed.untyped_storage().resize_(0)
    with MemoryTracker(limit=1000) as late:  # a storage freed before the tracker, re-allocated
        freed.untyped_storage().resize_(400)
        assert late.live == 400
        with pytest.raises(TrackedOOM):
            freed.untyped_storage().resize_(2000)
        with pytest.raises(RuntimeError, match="entered once"), late:
            pass
    assert torch.UntypedStorage.resize_ is memory._resize


def test_memory_tracker_counts_a_wrapper_subclass_by_its_inner_tensors():
    """A wrapper subclass (the AsyncCollectiveTensor a functional collective returns, a DTensor)
    has a storage of its own size that holds no data: counted, it doubled what TP (torch) held
    after each of its all-reduces. The tracker counts the tensors it wraps, once."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    m = MemoryTracker()
    with m:
        a = torch.zeros(1000)
        wrapped = torch.ops._c10d_functional._wrap_tensor_autograd(a)
        assert isinstance(wrapped, AsyncCollectiveTensor) and m.live == 4000
        del a
    m.track(wrapped)
    assert m.live == 4000 and m.peak == 4000
    del wrapped
    assert m.live == 0


BAD = [
    ("fsdp2_cp", {}, Layout(degree=2), 30, "seq_len=30: must be divisible by 2*D=4"),
    ("tp", {"kv_heads": 2}, Layout(degree=4), 32, "model.kv_heads=2: must be divisible by T=4"),
    ("tp", {}, Layout(degree=3), 32, "model.heads=8: must be divisible by T=3"),
    ("tpsp", {}, Layout(degree=4, tp=2, sp=1), 32, "tp=2 x sp=1 = 2: must equal degree=4"),
    ("sp", {}, Layout(degree=4), 36, "seq_len=36: must be divisible by 2*D=8"),
    ("fsdp_cp", {}, Layout(degree=2), 30, "seq_len=30: must be divisible by 2*D=4"),
    ("tsp", {}, Layout(degree=4), 20, "seq_len=20: must be divisible by 2*D=8"),
    ("tsp", {"heads": 4, "kv_heads": 4}, Layout(degree=8), 64, "model.heads=4: must be divisible"),
    ("dp", {}, Layout(degree=4), 32, "batch=2: must be divisible by degree=4"),
    ("single", {}, Layout(degree=2), 32, "degree=2: strategy 'single'"),
]


@pytest.mark.parametrize("name, model, layout, S, needle", BAD)
def test_bad_combinations_fail_before_any_collective(name, model, layout, S, needle):
    """validate() runs without a process group: it cannot have issued a collective."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ConfigError) as e:
        get_strategy(name).validate(get_config("tiny", **model), layout, S, 2)
    assert needle in str(e.value)


def test_unknown_strategy_is_named():
    with pytest.raises(ConfigError, match="strategy='nope': unknown; known: tsp, tp, tpsp"):
        get_strategy("nope")
    # one strategy per registry line, by the name its class gives (a new one adds a line only)
    assert list(strategies()) == [registry.load(e).name for e in registry.STRATEGIES]
