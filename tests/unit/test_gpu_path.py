"""The GPU path as far as a CPU can check it: which attention kernel a dtype gets, and the
flash-attn calls (layouts, the saved log-sum-exp, the backward adapter for three releases'
backward entry points, the last a torch custom op) through a stand-in package written in plain
math, and the fallback to SDPA, with its reason, of a flash-attn that cannot be used."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers.fake_flash_attn import install
from tspbench.core import attention


@pytest.mark.parametrize(
    "device, dtype, has_flash, torch_flash, want",
    [
        ("cuda", torch.bfloat16, True, True, "flash_attn"),
        ("cuda", torch.float16, True, True, "flash_attn"),
        ("cuda", torch.float32, True, True, "sdpa"),  # no flash kernel takes fp32
        ("cuda", torch.bfloat16, False, True, "torch_flash"),  # torch's own FlashAttention-2
        ("cuda", torch.bfloat16, False, False, "sdpa"),
        ("cpu", torch.float32, True, True, "cpu_flash"),
    ],
)
def test_flash_kernels_only_for_half_precision(monkeypatch, device, dtype, has_flash,
                                               torch_flash, want):  # fmt: skip
    problem = None if has_flash else "flash-attn is not installed"
    monkeypatch.setattr(attention, "flash_attn_problem", lambda: problem)
    monkeypatch.setattr(attention, "torch_flash_problem",
                        lambda d: None if torch_flash else "no flash kernels")  # fmt: skip
    assert attention.backend_for(torch.device(device), dtype) == want


def test_the_environment_names_the_kernel(monkeypatch, tmp_path):
    """``TSPBENCH_ATTENTION`` picks the kernel for every call; an unknown name is refused in
    one line naming the variable, the value and the choices, and ``run`` exits 2 on it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TSPBENCH_ATTENTION", "sdpa")
    assert attention.backend_for(torch.device("cpu"), torch.float32) == "sdpa"
    monkeypatch.setenv("TSPBENCH_ATTENTION", "fused")  # shapes fake tensors only
    from tspbench.cli import main
    from tspbench.core.config import ConfigError

    with pytest.raises(ConfigError, match="TSPBENCH_ATTENTION='fused': must be one of"):
        attention.backend_for(torch.device("cpu"), torch.float32)
    assert main(["run", "--strategy", "single", "--seq-len", "64", "--out", "x.json"]) == 2
    assert not list(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.parametrize("name, device, dtype, why", [
    ("torch_flash", "cpu", torch.bfloat16, "needs a GPU"),
    ("flash_attn", "cpu", torch.float32, "needs a GPU"),
    ("torch_flash", "cuda", torch.float32, "takes fp16 and bf16 only"),
    ("cpu_flash", "cuda", torch.bfloat16, "runs on a CPU only"),
])  # fmt: skip
def test_a_named_kernel_that_cannot_run_here_is_refused_before_the_run(
    monkeypatch, tmp_path, name, device, dtype, why
):
    """Not at the first attention call, which would write an error record after the start."""
    monkeypatch.setenv("TSPBENCH_ATTENTION", name)
    assert why in attention.env_backend_problem(device, dtype)
    monkeypatch.setenv("TSPBENCH_ATTENTION", "sdpa")
    assert attention.env_backend_problem(device, dtype) is None
    if device == "cpu":
        from tspbench.cli import main

        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("TSPBENCH_ATTENTION", name)
        argv = ["run", "--strategy", "single", "--seq-len", "64", "--out", "x.json"]
        assert main(argv) == 2 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("lq, lk, causal", [(8, 24, True), (8, 8, True), (8, 8, False)])
def test_torch_flash_calls_the_op_and_its_backward_as_torch_declares_them(lq, lk, causal):
    """PyTorch's FlashAttention-2 op and its backward, on meta tensors (their declared shapes
    and arguments, GQA's fewer K/V heads, a strided gradient), counted as every strategy's
    attention is: the causal (lower-right) pairs, backward 2.5 times forward."""
    from tspbench.runtime.flops import counter

    meta = {"device": "meta", "dtype": torch.bfloat16}
    q = torch.empty(1, 4, lq, 64, **meta)
    k = torch.empty(1, 2, lk, 64, **meta)
    dout = torch.empty(1, 4, 64, lq, **meta).transpose(2, 3)  # last dim strided
    flops = counter()
    with attention.forced("torch_flash"), flops:
        if causal:
            out, lse = attention.causal_fwd(q, k, k)
            grads = attention.causal_bwd(dout, q, k, k, out, lse)
        else:
            out, lse = attention.block_fwd(q, k, k, False)
            grads = attention.block_bwd(dout, q, k, k, out, lse, False)
    assert out.shape == q.shape and lse is not None and lse.shape == (1, 4, lq)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    pairs = attention.causal_pairs(lq, lk) if causal else lq * lk
    assert flops.get_total_flops() == 4 * 4 * 64 * pairs * 7 // 2


def _use(monkeypatch, root) -> None:
    """Make the package under ``root`` the importable flash_attn, judged afresh."""
    monkeypatch.syspath_prepend(str(root))
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(attention, "HAS_FLASH_ATTN", True)
    attention.flash_attn_problem.cache_clear()


@pytest.fixture(params=["2.5", "2.7", "2.7.4"])
def fake_flash(request, tmp_path, monkeypatch):
    _use(monkeypatch, install(tmp_path, request.param))
    yield request.param
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        sys.modules.pop(name, None)
    attention.flash_attn_problem.cache_clear()


def test_an_installed_flash_attn_is_used(fake_flash):
    assert attention.flash_attn_problem() is None
    assert attention.backend_for(torch.device("cuda"), torch.bfloat16) == "flash_attn"


@pytest.mark.parametrize(
    "version, broken, reason",
    [
        ("2.0.9", False, "aligns causal masks top-left"),  # before 2.1: wrong for zigzag
        ("2.7.4", True, "does not import (OSError"),  # built against another torch
    ],
)
def test_an_unusable_flash_attn_falls_back_to_sdpa_and_says_why(
    tmp_path, monkeypatch, version, broken, reason
):
    root = install(tmp_path, "2.7", version=version)
    if broken:  # what an ABI-mismatched extension raises when it loads
        interface = root / "flash_attn/flash_attn_interface.py"
        interface.write_text("raise OSError('undefined symbol: _ZN3c10...')\n")
    _use(monkeypatch, root)
    try:
        assert reason in (attention.flash_attn_problem() or "")
        assert attention.backend_for(torch.device("cuda"), torch.bfloat16) == "sdpa"
    finally:
        for name in ("flash_attn", "flash_attn.flash_attn_interface"):
            sys.modules.pop(name, None)
        attention.flash_attn_problem.cache_clear()


@pytest.mark.parametrize("lq, lk, hq, hkv", [(16, 16, 4, 4), (8, 24, 4, 2)])
def test_flash_forward_and_own_backward_equal_sdpa(fake_flash, lq, lk, hq, hkv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, hq, lq, 8, generator=g)
    k, v = (torch.randn(2, hkv, lk, 8, generator=g) for _ in range(2))
    dout = torch.randn(2, hq, lq, 8, generator=g)
    with attention.forced("flash_attn"):
        out, lse = attention.causal_fwd(q, k, v)
        grads = attention.causal_bwd(dout, q, k, v, out, lse)
    with attention.forced("sdpa"):
        ref, _ = attention.causal_fwd(q, k, v)
        ref_grads = attention.causal_bwd(dout, q, k, v, ref, None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert lse is not None and lse.shape == (2, hq, lq) and lse.dtype == torch.float32
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_flash_kernels_are_counted_like_the_cpu_kernel(fake_flash):
    """flash-attn's calls add the same FLOPs as the CPU flash kernel's registered formula, so
    MFU does not read low on a GPU (FlopCounterMode alone counts them as 0)."""
    from tspbench.runtime.flops import counter

    q, k, v, dout = (torch.randn(1, 4, 16, 8) for _ in range(4))
    totals = {}
    for backend in ("flash_attn", "cpu_flash"):
        with attention.forced(backend), counter() as c:
            out, lse = attention.causal_fwd(q, k, v)
            attention.causal_bwd(dout, q, k, v, out, lse)
        totals[backend] = c.get_total_flops()
    assert totals["flash_attn"] == totals["cpu_flash"] > 0
    assert attention.FLOP_LISTENERS == []  # the counter unregistered on exit


@pytest.mark.skipif(bool(torch.version.cuda or torch.version.hip), reason="needs a CPU-only torch")
def test_the_gpu_build_check_is_the_host_torch_unless_cells_run_in_an_image():
    """On this CPU-only torch a gpu: true sweep stops before any cell; under --sdm apptainer the
    image's torch runs the cells, so the host's is not the one to judge (each cell's --device
    cuda does, inside the image)."""
    from tspbench.core.config import ConfigError
    from tspbench.pipeline.cells import check_gpu_build

    with pytest.raises(ConfigError, match="built without CUDA or ROCm"):
        check_gpu_build({"gpu": True})
    check_gpu_build({"gpu": True}, in_image=True)
    check_gpu_build({"gpu": False})


@pytest.mark.parametrize(
    "local_rank, visible, want",
    [(0, 8, 0), (7, 8, 7), (3, 1, 0), (5, 1, 0), (2, 2, None), (8, 8, None)],
)
def test_each_rank_gets_its_own_gpu_or_a_clear_refusal(local_rank, visible, want):
    """A local rank takes the GPU of its number; one visible GPU is the one its launcher bound
    it to (Slurm --gpus-per-task); a local rank beyond several visible GPUs is refused up
    front, not left to share a GPU."""
    from tspbench.core.config import ConfigError
    from tspbench.runtime.launch import gpu_index

    if want is None:
        with pytest.raises(ConfigError, match=f"local rank {local_rank}: only {visible} GPUs"):
            gpu_index(local_rank, visible)
    else:
        assert gpu_index(local_rank, visible) == want


def test_metrics_and_step_times_are_reduced_on_the_step_device():
    """NCCL's process group has no CPU backend: every tensor a rank all-reduces must live on
    its device. The reductions of step times and of an empty gradient norm make theirs there
    (read from the code: no CUDA here to run them)."""
    import inspect

    from tspbench.core.optim import grad_sq_sum
    from tspbench.projection import calibrate
    from tspbench.runtime import comm_hiding, decode, measure, timing

    for module in (measure, comm_hiding):  # their step times: through timing.slowest
        assert "slowest(" in inspect.getsource(module), module.__name__
    seen = 0
    for module in (timing, decode, calibrate):
        src = inspect.getsource(module)
        for line in src.splitlines():
            if "torch.tensor(" in line and "float64" in line:
                assert "device=device" in line, f"{module.__name__}: {line.strip()}"
                seen += 1
    assert seen == 3  # timing.slowest (run, the overlap benchmark), decode's, calibration's
    meta = torch.nn.Parameter(torch.empty(2, device="meta"))
    assert grad_sq_sum([meta]).device.type == "meta"  # no gradient: on the parameters' device


def test_the_doctor_names_the_flash_attn_in_use_and_fails_an_unusable_one(tmp_path, monkeypatch):
    """``tspbench doctor``'s flash-attn line: the version the bf16 runs use, or FAILED with
    the reason when an installed flash-attn cannot be used (runs would silently take SDPA)."""
    from tspbench.pipeline import doctor

    _use(monkeypatch, install(tmp_path / "good", "2.7.4"))
    try:
        assert doctor.flash_attn_line().startswith("flash-attn 2.7.4:")
        _use(monkeypatch, install(tmp_path / "old", "2.7", version="2.0.9"))
        with pytest.raises(AssertionError, match="top-left.*falls back to PyTorch's SDPA"):
            doctor.flash_attn_line()
    finally:
        for name in ("flash_attn", "flash_attn.flash_attn_interface"):
            sys.modules.pop(name, None)
        attention.flash_attn_problem.cache_clear()


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("AMD Instinct MI300X", 1307e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_mfu_uses_the_parts_own_peak(name, peak):
    """The H100's PCIe and NVL parts are not the SXM's 989 TFLOP/s; an unlisted GPU gets no
    MFU rather than a wrong one."""
    from tspbench.runtime.flops import device_peak

    assert device_peak(name) == peak


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_gpu_check_run_is_a_valid_run(device, tmp_path):
    """gpu-check's runs, as it would launch them on a GPU: each parses and makes a valid spec
    (a GPU is rare: a refused argument found there costs the whole check)."""
    from tspbench.cli import make_parser
    from tspbench.pipeline.gpucheck import steps
    from tspbench.runtime.spec import RunSpec

    runs = [s for s in steps(tmp_path, device) if s.argv[3] == "run"]
    assert len(runs) == 3
    for step in runs:
        args = make_parser().parse_args(step.argv[3:])
        spec = RunSpec.from_args(args)
        assert spec.recompute == ("full" if device == "cuda" and spec.mode == "train" else "none")
