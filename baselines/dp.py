"""DP: every rank holds the whole model; the batch's sequences are split over the D ranks and
gradients are summed with one all-reduce after backward. ``single`` is DP on one rank: the
reference model behind the strategy interface.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tspbench.core import costs
from tspbench.core.attention import attention
from tspbench.core.config import ConfigError, ModelConfig
from tspbench.core.decode import DecodeHooks, head_step, local_attend, prefill_layers, run_layers
from tspbench.core.kvcache import KVCache, Step
from tspbench.core.layers import LayerHooks, cached, rope_on
from tspbench.core.mesh import Axis, Mesh
from tspbench.core.optim import grad_sq_sum
from tspbench.core.reference import LAYER_PARAMS, ReferenceModel
from tspbench.core.strategy import Batch, Layout, Strategy


class DP(Strategy):
    name = "dp"
    display = "DP"  # legends, titles and tables' captions

    @classmethod
    def replica_batch(cls, layout: Layout, per_rank: int = 1) -> int:
        return per_rank * layout.degree  # each rank takes whole sequences

    grad_staging_copies = 1  # finish_grads packs every gradient into one all-reduce

    @classmethod
    def schedule(cls, spec: costs.Spec) -> costs.Schedule:
        """One all-reduce of every gradient after backward."""
        ev, n = costs.Schedule(), cls.param_numel(spec.cfg, spec.layout)
        costs.grads_all_reduce(ev, spec, Axis.MODEL, spec.degree, n)
        return ev

    @classmethod
    def metric_reductions(cls, layout: Layout, train: bool) -> tuple[int, int]:
        return layout.degree, 1  # the loss is summed over the ranks' sequences

    @classmethod
    def validate(cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **_) -> None:
        super().validate(cfg, layout, seq_len, batch)
        if batch % layout.degree:
            raise ConfigError(
                f"batch={batch}: must be divisible by degree={layout.degree} "
                "(dp gives each rank whole sequences)"
            )

    def __init__(self, cfg: ModelConfig, mesh: Mesh, **kw) -> None:
        super().__init__(cfg, mesh, **kw)
        self.comm = mesh[Axis.MODEL]
        self.model = ReferenceModel(cfg, seed=self.seed, dtype=self.dtype, device=self.device)
        # whole sequences per rank, attended by the kernel every strategy takes (flash-attn on a
        # GPU), not the reference layer's own SDPA: the comparison is of layouts, not kernels
        self.hooks = LayerHooks(attn=attention)

    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        n, r = self.comm.size, self.comm.rank

        def rows(t: torch.Tensor) -> torch.Tensor:
            return self.dp_slice(t).chunk(n)[r].to(self.device)

        return Batch(rows(tokens), rows(labels), tokens.numel())

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(batch.tokens, self.checkpointed, self.hooks)
        logits = (hidden @ self.model.p("head").T).float()
        ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum")
        local = ce / batch.n_tokens
        return local, self.total_loss(local)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def finish_grads(self) -> None:
        super().finish_grads()
        self.all_reduce_grads(self.parameters(), self.comm)

    def grad_sq_norm(self) -> torch.Tensor:
        return grad_sq_sum(self.parameters())

    def hidden(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return self.comm.all_gather(self.model(batch.tokens, hooks=self.hooks), dim=0)

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        return {
            n: (p.grad if grads else p).detach() for n, p in self.model.named_full_params().items()
        }


class Single(DP):
    """The single-device reference (D must be 1)."""

    name = "single"
    display = "single device"  # legends, titles and tables' captions
    reference = True
    grad_staging_copies = 0  # one rank: nothing to reduce

    @classmethod
    def schedule(cls, spec: costs.Spec) -> costs.Schedule:
        return costs.Schedule()

    @classmethod
    def sweep_layouts(cls, degrees: list[int], factors: list[list[int]]) -> list[Layout]:
        return [Layout()]

    @classmethod
    def validate(cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **_) -> None:
        super().validate(cfg, layout, seq_len, batch)
        if layout.degree != 1:
            raise ConfigError(
                f"degree={layout.degree}: strategy 'single' runs one rank per replica (degree=1)"
            )

    # -- decode (docs/decode.md): the reference model with a KV cache ---------------------------
    decodes = True

    @classmethod
    def decode_schedule(cls, spec: costs.Spec) -> costs.Schedule:
        return costs.Schedule()

    def _layers(self) -> list[dict]:
        return [
            {k: self.model.p(f"layers.{i}.{k}") for k in LAYER_PARAMS}
            for i in range(self.cfg.layers)
        ]

    def _step(self, x: torch.Tensor) -> Step:
        return head_step(x, self.model.p("norm"), self.model.p("head"), self.cfg.norm_eps)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, max_len: int) -> tuple[KVCache, Step]:
        cfg, (B, P) = self.cfg, tokens.shape
        x = F.embedding(tokens.to(self.device), self.model.p("embed"))
        cache = KVCache.empty(cfg.layers, B, cfg.kv_heads, max_len, cfg.head_dim, x)
        cos, sin = cached(self, ("rope", P, x.dtype), lambda: rope_on(torch.arange(P), cfg, x))
        x = prefill_layers(cfg, self._layers(), x, cos, sin, self.hooks, cache)
        cache.start(P, P)
        return cache, self._step(x[:, -1])

    @torch.no_grad()
    def decode_step(self, cache: KVCache, tokens: torch.Tensor) -> Step:
        x = F.embedding(tokens.to(self.device), self.model.p("embed"))
        hooks = DecodeHooks(local_attend(cache))
        return self._step(run_layers(self.cfg, self._layers(), x, cache, hooks))
