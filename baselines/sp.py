"""SP (context parallelism): weights replicated, tokens zigzag over D ranks.

Each rank projects its own tokens; K/V are all-gathered along the sequence (reduce-scattered in
backward) for zigzag causal attention, through the same attention entry point as TSP. Every
other op is token-local. Gradients of the replicated weights are summed with one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tspbench.core import zigzag
from tspbench.core.attention import attention
from tspbench.core.collectives import GatherSequence
from tspbench.core.config import ModelConfig
from tspbench.core.layers import LayerHooks, rms_norm, rope_tables, transformer_layer
from tspbench.core.mesh import Mesh
from tspbench.core.reference import LAYER_PARAMS, param_shapes
from tspbench.core.strategy import Batch, Layout, Strategy


class SP(Strategy):
    name = "sp"

    @classmethod
    def mesh_dims(cls, layout: Layout) -> dict[str, int]:
        return {"dp": layout.dp, "model": layout.degree}

    @classmethod
    def validate(cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **_) -> None:
        super().validate(cfg, layout, seq_len, batch)
        zigzag.check_divisible(seq_len, layout.degree)

    def __init__(self, cfg: ModelConfig, mesh: Mesh, **kw) -> None:
        super().__init__(cfg, mesh, **kw)
        self.comm = mesh["model"]
        self.params = {n: self.to_param(self.init_full(n)) for n in param_shapes(cfg)}

    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        D, r = self.comm.size, self.comm.rank

        def local(t: torch.Tensor) -> torch.Tensor:
            return zigzag.shard(self.dp_slice(t), D, r).to(self.device)

        return Batch(local(tokens), local(labels), tokens.numel())

    def hidden_local(self, batch: Batch) -> torch.Tensor:
        cfg, p, D, r = self.cfg, self.params, self.comm.size, self.comm.rank
        S = batch.tokens.shape[1] * D
        x = F.embedding(batch.tokens, p["embed"])
        cos, sin = rope_tables(zigzag.positions(S, D, r), cfg.head_dim, cfg.rope_theta, x.dtype)
        cos, sin = cos.to(self.device), sin.to(self.device)
        to_g = zigzag.gathered_to_global(S, D).to(self.device)
        to_r = zigzag.global_to_gathered(S, D).to(self.device)

        def gather_kv(k: torch.Tensor, v: torch.Tensor):
            kv = GatherSequence.apply(torch.stack([k, v]), self.comm, 3, to_g, to_r)
            return kv[0], kv[1]

        hooks = LayerHooks(gather_kv=gather_kv, attn=lambda q, k, v: attention(q, k, v, r, D))
        for i in range(cfg.layers):
            lp = {k: p[f"layers.{i}.{k}"] for k in LAYER_PARAMS}
            x = self.layer(transformer_layer, x, lp, cfg.norm_eps, cfg.head_dim, cos, sin, hooks)
        return rms_norm(x, p["norm"], cfg.norm_eps)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = (self.hidden_local(batch) @ self.params["head"].T).float()
        ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum")
        local = ce / batch.n_tokens
        return local, self.total_loss(local)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())

    def finish_grads(self) -> None:
        super().finish_grads()
        self.all_reduce_grads(self.parameters(), self.comm)

    def grad_sq_norm(self) -> torch.Tensor:
        return sum(p.grad.float().pow(2).sum() for p in self.parameters())

    def hidden(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            h = self.hidden_local(batch)
        return zigzag.unshard(list(self.comm.all_gather(h, dim=1).chunk(self.comm.size, dim=1)))

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        return {n: (p.grad if grads else p).detach() for n, p in self.params.items()}
