"""TP (torch): PyTorch's DTensor tensor parallelism (``parallelize_module``, torchtitan's Llama
plan), with Megatron's sequence parallelism as an option, beside the suite's TP (model.py;
costs.py: its closed forms; no decode path)."""

from baselines.tp_torch.model import TPTorch

__all__ = ["TPTorch"]
