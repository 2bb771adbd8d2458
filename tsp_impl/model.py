"""The TSP transformer: every rank holds 1/D of every weight and 1/D of the tokens.

Parameters of rank r (nothing else is stored, so weights, grads and AdamW state are all 1/D):
    embed, head        rows r*V/D .. (r+1)*V/D                      [V/D, h]
    layers.i.attn      head group r packed [Wq_r; Wk_r; Wv_r; Wo_r^T] [(2n_h+2n_kv)d/D, h]
                       (Qwen2: then its QKV biases, zero-padded rows of width h)
    layers.i.mlp       slice r packed [W1_r; W3_r; W2_r^T]         [3f/D, h]
                       (moved by the ring or the broadcast schedule: mlp_schedule)
    norms              replicated (h elements each; Qwen3's QK norms d each); grads
                       all-reduced after backward
Tokens: zigzag chunks r and 2D-1-r of every sequence; RoPE at the tokens' global positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tsp_impl.attention import BroadcastAttention, bias_rows
from tsp_impl.costs import TSPCosts
from tsp_impl.decode import TSPDecoder
from tsp_impl.mlp import BroadcastMLP, RingMLP
from tsp_impl.mlp import bias_rows as mlp_bias_rows
from tsp_impl.mlp import biases as mlp_biases
from tsp_impl.moe import SCHEDULES as MOE_SCHEDULES
from tsp_impl.moe import tsp_experts
from tsp_impl.plan import TSPPlan
from tsp_impl.vocab import VocabEmbedding, VocabParallelLoss
from tsp_impl.weight_pass import WeightPass
from tspbench.core import moe, recompute, zigzag
from tspbench.core.config import ConfigError, ModelConfig
from tspbench.core.costs import Spec
from tspbench.core.init import chunk_slice
from tspbench.core.layers import rms_norm
from tspbench.core.mesh import Axis, Mesh
from tspbench.core.optim import grad_sq_sum
from tspbench.core.options import OVERLAP, Option, Value
from tspbench.core.reference import QK_NORMS, head_name
from tspbench.core.strategy import Batch, Layout, Strategy, tensor_of

MLP = {"ring": RingMLP, "broadcast": BroadcastMLP}

KV_BUCKET = Option(
    "kv_bucket", 0, "KV heads per attention bucket (0: whole head group)", bounds=(0, 65536),
    searched=True, short="kvb", bounded_by_default=True,  # a bucket repeats its group's calls
    tag="-kvb{value}", label=" (KV bucket {value})",
    note="(kvb: KV heads per gather, 0 the whole head group; the analytic memory models whole "
    "head groups: a bucket's saving shows only with --estimate)",
)  # fmt: skip
MLP_SCHEDULE = Option(
    "mlp_schedule", "ring",
    "how MLP weight slices move: ring (one neighbour per step) or broadcast (the owner to all; "
    "project: the hardware preset's topology chooses)",
    choices=tuple(MLP), searched=True, tag="-mlp-{value}", label=" ({value} MLP)", short="mlp",
)  # fmt: skip
KV_BACKWARD = Option(
    "kv_backward", "regather",
    "the attention backward re-gathers each head group's K/V (regather) or keeps the forward's "
    "(save: no backward gather, the full-sequence K/V of every head alive per layer)",
    choices=("regather", "save"), tag="-kv{value}", label=" (K/V saved)",
)  # fmt: skip
KV_EXCHANGE = Option(
    "kv_exchange", "all_gather",
    "how a head group's K/V cross the ranks: all_gather along the sequence (the paper's; "
    "reduce-scatter in backward) or ring: chunks passed point-to-point behind each chunk's "
    "attention, two alive at a time (Megatron-Core's p2p within TSP's head-group loop)",
    choices=("all_gather", "ring"), searched=True, tag="-kvx-{value}", label=" ({value} K/V)",
    short="kvx",
)  # fmt: skip

MOE_SCHEDULE = Option(
    "moe_schedule", "all_to_all",
    "how a model's experts meet its tokens: all_to_all (expert parallel: each token row to its "
    "experts' owner and back) or the experts move, ring or broadcast as the MLP's slices",
    choices=MOE_SCHEDULES, experts_only=True, searched=True, tag="-moe-{value}",
    label=" ({value} experts)",
    short="moe",
)  # fmt: skip


class TSP(Strategy):
    name = "tsp"
    display = "TSP"  # legends, titles and tables' captions
    costs = TSPCosts()  # tsp_impl/costs.py
    decoder = TSPDecoder  # tsp_impl/decode.py
    stages = True
    zero_bubble = True
    experts = True
    overlap: bool  # the options' values, set by Strategy.__init__
    kv_bucket: int
    mlp_schedule: str
    kv_backward: str
    kv_exchange: str
    moe_schedule: str
    # the record's order
    options = (OVERLAP, KV_BUCKET, MLP_SCHEDULE, KV_BACKWARD, KV_EXCHANGE, MOE_SCHEDULE)

    @classmethod
    def context_parallel(cls, layout: Layout) -> int:
        return layout.degree

    @classmethod
    def searched_values(cls, spec: Spec | None) -> dict[str, tuple[Value, ...]]:
        """Every bucket that splits a head group's KV heads: 0 (the whole group), then each
        proper divisor of kv_heads / D (none without a valid run)."""
        group = 0 if spec is None else spec.cfg.kv_heads // spec.layout.degree
        buckets = (0, *(b for b in range(1, group) if group % b == 0))
        return {**super().searched_values(spec), KV_BUCKET.name: buckets}

    @classmethod
    def checked_options(cls) -> list[dict[str, Value]]:
        """Each option's other values, a KV bucket of one head, and all of them at once."""
        mix: dict[str, Value] = {
            "overlap": False,
            "kv_bucket": 1,
            "mlp_schedule": "broadcast",
            "kv_backward": "save",
        }
        ring: dict[str, Value] = {**mix, "kv_backward": "regather", "kv_exchange": "ring"}
        return [*super().checked_options(), {KV_BUCKET.name: 1}, mix, ring]

    @classmethod
    def preset_options(cls, preset: dict) -> dict[str, Value]:
        """Broadcast on a fully connected mesh, where the owner's broadcast drives every link and
        a ring hop only one; ring on a switch (or unknown), where both run at the port's bandwidth
        and the ring moves a slice less per pass (docs/projection.md)."""
        mesh = preset.get("topology") == "full_mesh"
        return {MLP_SCHEDULE.name: "broadcast" if mesh else "ring"}

    @classmethod
    def validate(
        cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **options: Value
    ) -> None:
        super().validate(cfg, layout, seq_len, batch)
        kv_bucket = int(options.get(KV_BUCKET.name, KV_BUCKET.default))
        D = layout.degree
        zigzag.check_divisible(seq_len, D)
        dense = ("ffn",) if not cfg.moe else ("experts", "shared_ffn")  # E/D experts each
        for field in ("heads", "kv_heads", *dense, "vocab"):
            cls.require_divisible(f"model.{field}", getattr(cfg, field), D, "D (degree)")

        hkv = cfg.kv_heads // D
        if kv_bucket < 0 or (kv_bucket and hkv % kv_bucket):
            raise ConfigError(
                f"kv_bucket={kv_bucket}: must divide the KV heads per head group "
                f"(kv_heads / D = {hkv}), or be 0 for the whole group"
            )
        save = options.get(KV_BACKWARD.name, KV_BACKWARD.default) == "save"
        if save and options.get(KV_EXCHANGE.name, KV_EXCHANGE.default) == "ring":
            raise ConfigError(
                "kv_backward=save: needs kv_exchange=all_gather (the ring never holds a head "
                "group's whole-sequence K/V to keep)"
            )

    def __init__(self, cfg: ModelConfig, mesh: Mesh, **kw) -> None:
        super().__init__(cfg, mesh, **kw)
        if self.mlp_schedule not in MLP:
            raise ConfigError(
                f"mlp_schedule={self.mlp_schedule!r}: must be one of {', '.join(MLP)}"
            )
        self.comm = mesh[Axis.MODEL]
        D, r = self.comm.size, self.comm.rank
        rows = chunk_slice(cfg.vocab, D, r)  # the embedding's and the head's vocabulary rows
        first, last = self.stage.first, self.stage.last  # (a pipeline stage: its part only)
        self.tables = [self.to_param(self.init_block("embed", rows))] if first else []
        if last and not (cfg.tie_embeddings and first):  # tied: the head is the embedding
            # (its two grads sum), or on a pipeline's last stage the embedding's copy
            self.tables.append(self.to_param(self.init_block(head_name(cfg), rows)))
        self.norms = [self.to_param(self.init_block("norm"))] if last else []
        q, f, kv = cfg.q_dim, cfg.ffn, cfg.kv_dim
        own = {n: chunk_slice(n_out, D, r) for n, n_out in (("q", q), ("f", f), ("kv", kv))}
        self.layers = []
        for i in self.stage.layers:
            n = f"layers.{i}."  # each rank generates only its head group's rows (Wo, W2: columns)
            attn = torch.cat(
                [
                    self.init_block(n + "wq", own["q"]),
                    self.init_block(n + "wk", own["kv"]),
                    self.init_block(n + "wv", own["kv"]),
                    self.init_block(n + "wo", cols=own["q"]).T,
                    *self.bias_block(n, own),
                ]
            )
            self.layers.append(
                {
                    "attn_norm": self.to_param(self.init_block(n + "attn_norm")),
                    "attn": self.to_param(attn),
                    "mlp_norm": self.to_param(self.init_block(n + "mlp_norm")),
                    **{k: self.to_param(v) for k, v in self.mlp_blocks(n, own).items()},
                    **{k: self.to_param(self.init_block(n + k)) for k in self.whole},
                }
            )
        self._plans: dict[int, TSPPlan] = {}
        self.recomputing = False  # set while backward recomputes a layer (checkpointed)
        self.weight_pass: WeightPass | None = None  # a zero-bubble schedule's (split_backward)

    def mlp_blocks(self, n: str, own: dict[str, slice]) -> dict[str, torch.Tensor]:
        """Layer ``n``'s MLP weights on rank r: slice r packed [W1_r; W3_r; W2_r^T] (``mlp``);
        with experts, its E/D experts packed likewise, one [W1_e; W3_e; W2_e^T] block each
        (``mlp``), and a shared expert's slice r (``shared``, Qwen2-MoE)."""
        if not self.cfg.moe:
            w13 = [self.init_block(n + k, own["f"]) for k in ("w1", "w3")]
            w2t = self.init_block(n + "w2", cols=own["f"]).T
            return {"mlp": torch.cat([*w13, w2t, *self.mlp_bias_block(n, own)])}
        D, r = self.comm.size, self.comm.rank
        mine = chunk_slice(self.cfg.experts, D, r)
        w1, w3, w2 = (self.init_block(n + k, mine) for k in ("ew1", "ew3", "ew2"))
        out = {"mlp": torch.cat([w1, w3, w2.transpose(1, 2)], dim=1).flatten(0, 1)}
        if self.cfg.shared_ffn:
            fs = chunk_slice(self.cfg.shared_ffn, D, r)
            w2t = self.init_block(n + "sw2", cols=fs).T
            out["shared"] = torch.cat([self.init_block(n + k, fs) for k in ("sw1", "sw3")] + [w2t])
        return out

    def bias_block(self, n: str, own: dict[str, slice]) -> list[torch.Tensor]:
        """Head group r's QKV biases as the zero-padded rows of width h its packed shard ends
        with (none without biases): one broadcast moves them with the weights."""
        rows = bias_rows(self.cfg, self.comm.size)
        if not rows:
            return []
        parts = [
            self.init_block(n + b, own[k]) for b, k in (("bq", "q"), ("bk", "kv"), ("bv", "kv"))
        ]
        flat = torch.cat(parts)
        return [F.pad(flat, (0, rows * self.cfg.hidden - flat.numel())).view(rows, -1)]

    def mlp_bias_block(self, n: str, own: dict[str, slice]) -> list[torch.Tensor]:
        """Slice r's [b1_r; b3_r] (Llama's mlp_bias) as the zero-padded rows of width h its
        packed slice ends with (none without): they travel with the slice."""
        if not self.cfg.mlp_bias:
            return []
        flat = torch.cat([self.init_block(n + b, own["f"]) for b in ("b1", "b3")])
        rows = mlp_bias_rows(flat.numel() // 2, self.cfg.hidden)
        return [F.pad(flat, (0, rows * self.cfg.hidden - flat.numel())).view(rows, -1)]

    def plan(self, seq_len: int) -> TSPPlan:
        if seq_len not in self._plans:
            self._plans[seq_len] = TSPPlan.build(
                self.comm, self.cfg, seq_len, self.dtype, self.device, self.overlap,
                self.kv_bucket, self.kv_backward == "save", self.kv_exchange == "ring",
            )  # fmt: skip
        return self._plans[seq_len]

    # -- running --------------------------------------------------------------------------------
    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        return self.zigzag_batch(tokens, labels, self.comm)

    def hidden_local(self, batch: Batch) -> torch.Tensor:
        x = self.run_layers(self.embed(batch.tokens))
        return rms_norm(x, self.norms[0], self.cfg.norm_eps)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return VocabEmbedding.apply(tokens, self.tables[0], self.comm, self.overlap)

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan(x.shape[1] * self.comm.size)
        eps = self.cfg.norm_eps

        def block(x: torch.Tensor, lp: dict) -> torch.Tensor:
            grad = torch.is_grad_enabled()  # inference keeps nothing for a backward
            # residuals ride in the output GEMMs: x + attention(norm(x)), then x + MLP(norm(x))
            x = BroadcastAttention.apply(
                x, rms_norm(x, lp["attn_norm"], eps), lp["attn"], plan, grad, self.weight_pass,
                *(lp[k] for k in self.qk_norms),
            )  # fmt: skip
            if "bo" in lp:  # Llama's attention_bias: W_o's bias, whole, added once
                x = x + lp["bo"]
            # (the normed input is a temporary: inference frees it after the attention)
            mlp_in = rms_norm(x, lp["mlp_norm"], eps)
            if self.cfg.moe:
                return x + self.moe_block(mlp_in, lp, grad)
            mlp = MLP[self.mlp_schedule]
            x = mlp.apply(
                x, mlp_in, lp["mlp"], self.comm, self.overlap, grad, self.recomputing,
                self.cfg.mlp_bias, self.weight_pass,
            )  # fmt: skip
            return x + lp["b2"] if "b2" in lp else x

        for lp in self.layers:
            x = self.checkpointed(block, x, lp)
        return x

    def moe_block(self, m: torch.Tensor, lp: dict, grad: bool) -> torch.Tensor:
        """The mixture of experts on this rank's normed tokens: routed here (the replicated
        router), the experts met by ``moe_schedule`` (tsp_impl/moe.py); a shared expert is a
        dense MLP slice on TSP's MLP schedule, scaled by its gate."""
        cfg, shape = self.cfg, m.shape
        m2 = m.reshape(-1, shape[-1])
        _, weights, idx = moe.route(m2, lp["router"], cfg.top_k, cfg.norm_topk, self.router_stats)
        y = tsp_experts(
            m2, weights, idx, lp["mlp"], self.comm, self.overlap, self.moe_schedule,
            cfg.experts, cfg.moe_ffn,
        )  # fmt: skip
        if "shared" in lp:  # (its output is used, recomputed or not: the gate scales it)
            mlp = MLP[self.mlp_schedule]
            sh = mlp.apply(
                torch.zeros_like(m), m, lp["shared"], self.comm, self.overlap, grad, False, False,
                self.weight_pass,
            )  # fmt: skip
            y = y + torch.sigmoid(m2 @ lp["sgate"].T) * sh.reshape(m2.shape)
        return y.view(shape)

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
        h = rms_norm(x, self.norms[0], self.cfg.norm_eps)
        head = self.tables[-1]
        return VocabParallelLoss.apply(h, head, labels, n_tokens, self.comm, self.overlap)

    def checkpointed(self, fn, *args):
        """As :meth:`Strategy.checkpointed`, with ``self.recomputing`` set while backward
        recomputes the layer: the MLP then computes only what it saves (its output is not used)."""
        if self.recompute == "full" and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(
                fn, *args, use_reentrant=False, context_fn=self._recompute_contexts
            )
        return fn(*args)

    def _recompute_contexts(self):
        @contextlib.contextmanager
        def recomputing():
            self.recomputing = True
            try:
                with recompute.recomputing():
                    yield
            finally:
                self.recomputing = False

        return contextlib.nullcontext(), recomputing()

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        self.router_stats = moe.RouterStats() if self.cfg.moe else None
        x = self.run_layers(self.embed(batch.tokens))
        local = self.head_loss(x, batch.labels, batch.n_tokens)
        if self.router_stats is not None:
            local = local + self.routing_done(self.router_stats)
        self.router_stats = None
        return local, self.reported_loss(local)

    @property
    def qk_norms(self) -> tuple[str, ...]:
        """The QK norms' names where the model has them (Qwen3): replicated, as the others."""
        return QK_NORMS if self.cfg.qk_norm else ()

    @property
    def whole(self) -> tuple[str, ...]:
        """A layer's weights every rank holds whole besides its two norms: the QK norms and the
        output biases (Llama's bo, b2), where the model has them."""
        experts = ("router",) + ("sgate",) * bool(self.cfg.shared_ffn) if self.cfg.moe else ()
        return self.qk_norms + ("bo",) * self.cfg.o_bias + ("b2",) * self.cfg.mlp_bias + experts

    def tied_table(self) -> list[torch.nn.Parameter]:
        return self.tables[:1]  # (the embedding's rows, or the last stage's copy of them)

    def schedule_done(self) -> None:
        super().schedule_done()
        if self.weight_pass is not None:
            self.weight_pass.check_done()

    def split_backward(self) -> Callable[[], Callable[[], None]]:
        """TSP's own weight pass (tsp_impl/weight_pass.py): its layers' shards move inside one
        autograd.Function each, where torch's graph split finds no weight pass to defer."""
        self.weight_pass = WeightPass()
        return self.weight_pass.take

    def replicated(self) -> list[torch.nn.Parameter]:
        names = ("attn_norm", "mlp_norm", *self.whole)
        return self.norms + [lp[k] for lp in self.layers for k in names]

    def sharded(self) -> list[torch.nn.Parameter]:
        shared = ("shared",) * bool(self.cfg.shared_ffn)
        return self.tables + [lp[k] for lp in self.layers for k in ("attn", "mlp", *shared)]

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.sharded() + self.replicated()

    def finish_grads(self) -> None:
        """Norm weights are replicated: sum their local-token gradients over the group."""
        super().finish_grads()
        self.all_reduce_grads(self.replicated(), self.comm)

    def grad_sq_norm(self) -> torch.Tensor:
        return self.comm.all_reduce_metric(grad_sq_sum(self.sharded())) + grad_sq_sum(
            self.replicated()
        )

    # -- checking -------------------------------------------------------------------------------
    def hidden(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            h = self.hidden_local(batch)
        return zigzag.unshard(list(self.comm.all_gather(h, dim=1).chunk(self.comm.size, dim=1)))

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        D = self.comm.size
        d, hq, hkv = self.cfg.d_head, self.cfg.heads // D, self.cfg.kv_heads // D

        def g(p: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return self.comm.all_gather(tensor_of(p, grads), dim=0).chunk(D)

        names = [n for n in ("embed", "head") if self.stage.holds(n)][: len(self.tables)]
        out = {n: torch.cat(g(t)) for n, t in zip(names, self.tables)}
        if self.norms:
            out["norm"] = tensor_of(self.norms[0], grads)
        rb = bias_rows(self.cfg, D)
        for i, lp in zip(self.stage.layers, self.layers):
            pre = f"layers.{i}."
            parts = [s.split([hq * d, hkv * d, hkv * d, hq * d, rb]) for s in g(lp["attn"])]
            for j, k in enumerate(("wq", "wk", "wv")):
                out[pre + k] = torch.cat([p[j] for p in parts])
            out[pre + "wo"] = torch.cat([p[3].T for p in parts], dim=1)
            if rb:  # each group's [bq_r; bk_r; bv_r], padded
                flat = [p[4].flatten()[: (hq + 2 * hkv) * d] for p in parts]
                biases = [f.split([hq * d, hkv * d, hkv * d]) for f in flat]
                for j, k in enumerate(("bq", "bk", "bv")):
                    out[pre + k] = torch.cat([b[j] for b in biases])
            if self.cfg.moe:
                out.update(self.full_experts(pre, lp, g))
                for k in ("attn_norm", "mlp_norm", *self.whole):
                    out[pre + k] = tensor_of(lp[k], grads)
                continue
            fd = self.cfg.ffn // D
            parts = [s[: 3 * fd].chunk(3) for s in g(lp["mlp"])]
            out[pre + "w1"] = torch.cat([p[0] for p in parts])
            out[pre + "w3"] = torch.cat([p[1] for p in parts])
            out[pre + "w2"] = torch.cat([p[2].T for p in parts], dim=1)
            if self.cfg.mlp_bias:  # each slice's [b1_r; b3_r], padded
                flat = [mlp_biases(s, fd).split(fd) for s in g(lp["mlp"])]
                out[pre + "b1"] = torch.cat([b[0] for b in flat])
                out[pre + "b3"] = torch.cat([b[1] for b in flat])
            for k in ("attn_norm", "mlp_norm", *self.whole):
                out[pre + k] = tensor_of(lp[k], grads)
        return out

    def full_experts(self, pre: str, lp: dict, g) -> dict[str, torch.Tensor]:
        """A layer's whole expert stacks (and shared expert) from every rank's packed blocks."""
        fe, h = self.cfg.moe_ffn, self.cfg.hidden
        blocks = torch.cat([s.view(-1, 3 * fe, h) for s in g(lp["mlp"])])  # [E, 3 f_e, h]
        out = {pre + "ew1": blocks[:, :fe], pre + "ew3": blocks[:, fe : 2 * fe]}
        out[pre + "ew2"] = blocks[:, 2 * fe :].transpose(1, 2)
        if "shared" in lp:
            parts = [s.chunk(3) for s in g(lp["shared"])]
            out[pre + "sw1"] = torch.cat([p[0] for p in parts])
            out[pre + "sw3"] = torch.cat([p[1] for p in parts])
            out[pre + "sw2"] = torch.cat([p[2].T for p in parts], dim=1)
        return out
