"""``tspbench doctor``: is this node ready for a sweep? One line per check (ok / FAILED /
skipped: why), run before committing GPU-hours.

What it checks: the devices and versions; the zigzag attention of every kernel this node has,
forward and backward, against PyTorch's SDPA on the same inputs (fp32, and bf16 where the kernel
takes it); every strategy at D = 1 against the single-device reference on the device (loss and
every gradient), on a GPU in bf16 too (flash-attn's kernels and TSP's own backward); which
flash-attn the runs use (an installed one that cannot be used fails the check); on 2+ GPUs,
every registered strategy that takes D = 2 (each T x Sigma of a factored one) with NCCL/RCCL
against the single device; the rank probe (:mod:`tspbench.pipeline.rank_probe`: rank 0 of
every strategy's D = 8 cell run for real on torch's fake process group, so one GPU, or a CPU,
runs the kernels and allocations a sweep's ranks will, its peak against the fake-tensor
estimate); the real ``torch.cuda.max_memory_allocated`` peak of a D = 1 cell against its
estimate; and GEMM/attention rates as a hardware preset (``tspbench calibrate --device cuda``).
On a CPU machine the CPU parts run (the rank probe on a small fp32 cell) and the rest are
skipped, saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from tspbench.core import attention
from tspbench.core.config import get_config
from tspbench.core.dtypes import DTYPES
from tspbench.core.mesh import build_mesh
from tspbench.core.reference import ReferenceModel, make_batch
from tspbench.core.strategy import Layout
from tspbench.pipeline.check import Check, in_bound, run_check
from tspbench.pipeline.rank_probe import layouts, probe_plan, results
from tspbench.runtime.record import versions, write_json
from tspbench.runtime.registry import reference_name, strategies
from tspbench.runtime.spec import RunSpec

TOL = {"fp32": 1e-4, "bf16": 3e-2}  # max error relative to each tensor's max


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None  # a leaf that requires grad, after the backward
    return t.grad


def _err(a: torch.Tensor, b: torch.Tensor | None) -> float:
    assert b is not None, "the reference has no such gradient"  # (b: a reference's .grad)
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def devices() -> str:
    v = versions("nccl" if torch.cuda.is_available() else "gloo")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    shown = ", ".join(f"{k} {x}" for k, x in v.items() if x)
    kinds = f" ({', '.join(sorted(set(names)))})" if names else ""
    return f"{len(names)} GPU(s){kinds}; {shown}"


def kernels(device: torch.device) -> list[tuple[str, str]]:
    """(kernel, dtype) pairs this node runs through the attention entry point."""
    out = []
    for dtype in DTYPES:
        if device.type == "cpu" and dtype == "bf16":
            out.append(("cpu_flash", dtype))  # small shapes: bf16 matmul is slow on CPUs
            continue
        out.append((attention.backend_for(device, DTYPES[dtype]), dtype))
    if device.type == "cuda":
        out += [("sdpa", "bf16")]
    return sorted(set(out))


def attention_check(device: torch.device, kernel: str, dtype: str) -> str:
    """Zigzag attention at D = 2 (both ranks' chunks) and plain causal, forward and backward,
    against SDPA with an explicit mask on the same inputs (fp32 math as the reference)."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, S, d = 2, 4, 2, 256, 64
    q = torch.randn(B, H, S, d, generator=g)
    k, v = (torch.randn(B, Hkv, S, d, generator=g) for _ in range(2))
    dout = torch.randn(B, H, S, d, generator=g)
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        ref_q, ref_k, ref_v, is_causal=True, enable_gqa=True
    )
    ref.backward(dout)
    dt = DTYPES[dtype]
    worst = 0.0
    from tspbench.core import zigzag

    for degree in (1, 2):
        outs, grads = [], []
        for rank in range(degree):
            ql = zigzag.shard(q, degree, rank, dim=2) if degree > 1 else q
            qq, kk, vv = (t.detach().to(device, dt).clone().requires_grad_() for t in (ql, k, v))
            with attention.forced(kernel):
                o = attention.attention(qq, kk, vv, rank, degree)
                dl = zigzag.shard(dout, degree, rank, dim=2) if degree > 1 else dout
                o.backward(dl.to(device, dt))
            outs.append(o.float().cpu())
            grads.append(tuple(_grad(t).float().cpu() for t in (qq, kk, vv)))
        out = zigzag.unshard(outs, dim=2) if degree > 1 else outs[0]
        dq = zigzag.unshard([x[0] for x in grads], dim=2) if degree > 1 else grads[0][0]
        dk, dv = (sum((x[i] for x in grads[1:]), grads[0][i]) for i in (1, 2))
        pairs = ((out, ref, "out"), (dq, ref_q.grad, "dq"), (dk, ref_k.grad, "dk"))
        for got, want, what in (*pairs, (dv, ref_v.grad, "dv")):
            e = _err(got, want)
            worst = max(worst, e)
            assert e <= TOL[dtype], f"D={degree} {what}: error {e:.2e} > {TOL[dtype]:g}"
    worst = max(worst, _ring_blocks(device, kernel, dtype, (q, k, v, dout)))
    return (
        f"D=1 and D=2 forward/backward, and ring blocks merged by their log-sum-exp, within "
        f"{worst:.1e} of SDPA (tolerance {TOL[dtype]:g})"
    )


def _ring_blocks(device: torch.device, kernel: str, dtype: str, inputs: tuple) -> float:
    """The ring's use of a kernel: the last half of the queries over two blocks (the earlier
    keys unmasked, the diagonal causal), merged by log-sum-exp, forward and backward, against
    the float64 oracle of the same rows: what makes the ring's exchange exact on this kernel."""
    q, k, v, dout = inputs
    h = q.shape[2] // 2
    want = [t.double().requires_grad_() for t in (q[:, :, h:], k, v)]
    g = q.shape[1] // k.shape[1]  # GQA: the oracle takes every head's K/V
    ref = attention._math_causal(want[0], *(t.repeat_interleave(g, 1) for t in want[1:]))
    ref.backward(dout[:, :, h:].double())
    qh, kk, vv, dh = (t.to(device, DTYPES[dtype]) for t in (q[:, :, h:], k, v, dout[:, :, h:]))
    with attention.forced(kernel):
        o1, l1 = attention.block_fwd(qh, kk[:, :, :h], vv[:, :, :h], False)
        o2, l2 = attention.block_fwd(qh, kk[:, :, h:], vv[:, :, h:], True)
        lse = torch.logaddexp(l1, l2)
        out = o1.float() * (l1 - lse).exp()[..., None] + o2.float() * (l2 - lse).exp()[..., None]
        out = out.to(qh.dtype)
        g1 = attention.block_bwd(dh, qh, kk[:, :, :h], vv[:, :, :h], out, lse, False)
        g2 = attention.block_bwd(dh, qh, kk[:, :, h:], vv[:, :, h:], out, lse, True)
    got = (out, g1[0] + g2[0], torch.cat([g1[1], g2[1]], 2), torch.cat([g1[2], g2[2]], 2))
    worst = 0.0
    for x, w, what in zip(got, (ref, *(_grad(t) for t in want)), ("out", "dq", "dk", "dv")):
        e = _err(x, w)
        worst = max(worst, e)
        assert e <= TOL[dtype], f"ring blocks {what}: error {e:.2e} > {TOL[dtype]:g}"
    return worst


def strategy_check(device: torch.device, name: str, dtype: str = "fp32") -> str:
    """One training step at D = 1 on the device: loss and every gradient vs the reference."""
    cfg = get_config("tiny")
    impl = strategies()[name]
    mesh = build_mesh(impl.mesh_dims(impl.make_layout(1, 1, 1, 1)))
    strat = impl(cfg, mesh, seed=0, dtype=DTYPES[dtype], device=device)
    tokens, labels = make_batch(cfg, 2, 64, 0)
    ref = ReferenceModel(cfg, seed=0, device=device)
    ref_loss, _ = ref.loss(tokens.to(device), labels.to(device))
    ref_loss.backward()
    loss = strat.forward_backward(strat.shard_batch(tokens, labels))
    errors = {"loss": _err(loss, ref_loss)}
    ref_grads = {n: p.grad for n, p in ref.named_full_params().items()}
    for n, grad in strat.full_params(grads=True).items():
        errors[n] = _err(grad, ref_grads[n])
    worst = max(errors, key=lambda n: errors[n])
    assert errors[worst] <= TOL[dtype], f"{worst}: error {errors[worst]:.2e} > {TOL[dtype]:g}"
    return f"loss and {len(errors) - 1} gradients within {errors[worst]:.1e}"


def flash_attn_line() -> str:
    """Which flash-attn the bf16 runs use; raises (FAILED) when one is installed but unusable
    (the runs then fall back to SDPA: slower, other memory)."""
    problem = attention.flash_attn_problem()
    if problem and attention.HAS_FLASH_ATTN:
        raise AssertionError(f"{problem}: bf16 attention falls back to PyTorch's SDPA")
    import flash_attn

    return f"flash-attn {flash_attn.__version__}: bf16/fp16 attention uses its kernels"


def two_gpu_specs() -> list[RunSpec]:
    """Every registered strategy that takes a model group of 2 (each factorisation of it), on
    the small cell the D = 2 check runs."""
    cfg = get_config("tiny")
    return [
        RunSpec(strategy=name, cfg=cfg, layout=lay, seq_len=256, batch=2)
        for name, impl in strategies().items()
        for lay in layouts(impl, 2)
    ]


def two_gpu_check(spec: RunSpec) -> str:
    """``spec`` at D = 2 on two GPUs (NCCL/RCCL) gives the single device's loss and norm on the
    same batch."""
    recs = {}
    single = spec.replace(strategy=reference_name(), layout=Layout())
    with tempfile.TemporaryDirectory() as tmp:
        for key, run in (("run", spec), ("single", single)):
            out = Path(tmp) / f"{key}.json"
            argv = [*run.to_argv(), "--steps", "1", "--warmup", "0", "--device", "cuda"]
            argv += ["--launch", "local", "--quiet", "--out", str(out)]
            p = subprocess.run(
                [sys.executable, "-m", "tspbench", "run", *argv], capture_output=True
            )
            assert p.returncode == 0, p.stderr.decode()[-400:]
            recs[key] = json.loads(out.read_text())
    a, b = recs["run"], recs["single"]
    for key in ("loss", "grad_norm"):
        e = abs(a[key] - b[key]) / abs(b[key])
        assert e < 1e-4, f"{key}: {a[key]} vs single {b[key]}"
    return f"loss {a['loss']:.6f}, grad norm {a['grad_norm']:.6f} = single's"


def memory_check(device: torch.device) -> str:
    """The measured peak of a real cell against the fake-tensor estimate of the same cell."""
    from tspbench.projection.estimate import estimate

    spec = RunSpec.make("tsp", get_config("small"), degree=1, seq_len=2048, dtype="bf16")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cell.json"
        argv = [*spec.to_argv(), "--device", "cuda", "--launch", "local", "--out", str(out)]
        p = subprocess.run([sys.executable, "-m", "tspbench", "run", *argv], capture_output=True)
        assert p.returncode == 0, p.stderr.decode()[-400:]
        measured = json.loads(out.read_text())["peak_mem_bytes"]
    est = estimate(spec, [0], "fused")["peak_mem_bytes"]
    ratio = measured / est
    assert in_bound(ratio), f"measured {measured / 2**20:.1f} MiB, estimate {est / 2**20:.1f}"
    return f"measured/estimate = {ratio:.3f} ({measured / 2**20:.1f} / {est / 2**20:.1f} MiB)"


def calibrate_check(out_dir: Path, gpus: int) -> str:
    """A preset from this node's rates; its collectives too where two GPUs can measure them
    (on one GPU the preset has no measured link: its collective rates are placeholders)."""
    path = out_dir / "calibrated-gpu.json"
    ranks = "1,2" if gpus >= 2 else "1"
    argv = [
        "calibrate",
        "--device",
        "cuda",
        "--dtype",
        "bf16",
        "--ranks",
        ranks,
        "--out",
        str(path),
    ]
    p = subprocess.run([sys.executable, "-m", "tspbench", *argv], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-400:]
    links = "" if gpus >= 2 else " (one GPU: no link measured)"
    return p.stdout.strip().splitlines()[0] + f"; preset {path}{links}"


def doctor(out_dir: Path | None = None) -> list[Check]:
    """Run every check in order (printing each line as it finishes)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    no_gpu = None if gpus else "no GPU visible"
    plan: list[tuple[str, Callable[[], str | None], str | None]] = [
        ("devices and versions", devices, None)
    ]
    for kernel, dtype in kernels(device):
        plan.append((f"attention {kernel} {dtype}", partial(attention_check, device, kernel, dtype),
                     None))  # fmt: skip
    flash = None if gpus and attention.HAS_FLASH_ATTN else "no GPU visible"
    if gpus and not attention.HAS_FLASH_ATTN:
        flash = "flash-attn is not installed: bf16 attention runs on PyTorch's SDPA"
    plan.append(("flash-attn", flash_attn_line, flash))
    for name in strategies():
        plan.append((f"strategy {name} D=1 on {device.type}", partial(strategy_check, device,
                     name), None))  # fmt: skip
        if gpus:  # bf16: the kernels real runs take (flash-attn and TSP's own backward)
            plan.append((f"strategy {name} D=1 bf16", partial(strategy_check, device, name,
                         "bf16"), None))  # fmt: skip
    two = None if gpus >= 2 else f"needs 2 GPUs ({gpus} visible)"
    for spec in two_gpu_specs():
        label = spec.impl.label(spec.layout)
        plan.append((f"{label} D=2 with NCCL/RCCL", partial(two_gpu_check, spec), two))
    found: dict[str, dict] = {}  # one rank of D = 8 for real, on the fake process group
    probes = probe_plan(device, found)
    plan += probes
    plan.append(("peak memory vs estimate", lambda: memory_check(device), no_gpu))
    where = out_dir or Path(".")
    plan.append(("calibrate rates", lambda: calibrate_check(where, gpus), no_gpu))
    checks = []
    for name, fn, skip in plan:
        checks.append(run_check(name, fn, skip))
        print(checks[-1].line(), flush=True)
    if out_dir is not None:
        probed = [c for c in checks if c.name in {name for name, _, _ in probes}]
        write_json(
            out_dir / "doctor.json",
            {"checks": [asdict(c) for c in checks], "rank_probe": results(probed, found)},
        )
    return checks
