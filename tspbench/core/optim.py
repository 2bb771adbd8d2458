"""AdamW over a rank's local tensors, shared by every strategy so updates are comparable.

With low-precision parameters (bf16) it keeps fp32 master weights and moments (mixed-precision
AdamW, the paper's setup); with fp32 parameters it steps them directly. State is element-wise,
so a rank holding 1/D of the weights holds 1/D of the optimizer state.

The step is torch's fused AdamW, one kernel over all of a rank's tensors, as torchtitan's default
and Megatron's FusedAdam run it: a strategy with many small weights (TP's nine per layer) pays
no more kernel launches for them than one that packs its weights (TSP's four), and the step
allocates no temporaries beyond the fp32 gradient copies of bf16 weights.
"""

from __future__ import annotations

import torch


class AdamW:
    def __init__(
        self,
        params: list[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
    ) -> None:
        self.params = params
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in params
        ]
        self.inner = torch.optim.AdamW(
            self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True
        )
        self.low = [(p, m) for p, m in zip(params, self.masters) if m is not p]

    @torch.no_grad()
    def step(self) -> None:
        for p, m in self.low:
            if p.grad is not None:
                m.grad = p.grad.float()
        self.inner.step()
        if self.low:
            torch._foreach_copy_([p for p, _ in self.low], [m for _, m in self.low])
            for _, m in self.low:
                m.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_numel(self) -> int:
        """Elements of optimizer state (moments, plus fp32 masters when params are not fp32)."""
        n = sum(t.numel() for s in self.inner.state.values() for t in s.values() if t.dim())
        return n + sum(m.numel() for p, m in zip(self.params, self.masters) if m is not p)


def grad_sq_sum(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Sum of the squared gradient elements of ``params``, in fp32, by one multi-tensor norm (as
    ``clip_grad_norm_`` computes it): every strategy uses it, so none pays per-tensor kernels."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:  # on the parameters' device: NCCL all-reduces no CPU tensor
        return torch.zeros((), device=params[0].device if params else "cpu")
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
