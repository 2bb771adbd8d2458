"""TP (torch): PyTorch's own tensor parallelism, DTensor's ``parallelize_module`` with the plan
torchtitan applies to a Llama block, beside the suite's hand-written Megatron TP (``baselines/tp``).

The model is ``nn.Module``s (``nn.Embedding``, ``nn.Linear``, an RMSNorm) built on the meta
device, parallelised over the model group, then given only this rank's shard of each weight:

- ``wq``, ``wk``, ``wv``, ``w1``, ``w3``: ``ColwiseParallel``; ``wo``, ``w2``: ``RowwiseParallel``;
  each block's attention and MLP take their input through ``PrepareModuleInput`` (one DTensor
  for the three projections, so one reduction of its gradient, as Megatron's ``copy_to``);
- the embedding ``RowwiseParallel`` (vocabulary rows; a masked lookup summed over the group),
  the LM head ``ColwiseParallel`` with its logits left sharded by vocabulary and the
  cross-entropy under ``loss_parallel`` (torch's vocabulary-parallel loss);
- ``sequence_parallel`` on: Megatron's sequence parallelism, torchtitan's default. The norms run
  under ``SequenceParallel`` on sequence shards, and each all-reduce becomes a reduce-scatter
  (the row-parallel outputs, the embedding) with an all-gather before the column-parallel
  projections: the same bytes as TP's all-reduces, and activations outside the projections
  1/T of TP's.

DTensor issues its collectives as functional collectives (``_c10d_functional`` ops): a dispatch
mode (:class:`Counted`) runs each through the counted :class:`tspbench.core.comm.Comm`, so they
are counted, staged and traced as every strategy's are, and one it does not know stops the run.
The optimizer is the suite's shared AdamW over this rank's local shards (aliases of DTensor's
local tensors), as FSDP2+CP's is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from baselines.tp_torch.costs import TPTorchCosts
from tspbench.core.attention import attention
from tspbench.core.comm import Comm
from tspbench.core.config import ModelConfig
from tspbench.core.init import chunk_slice
from tspbench.core.layers import cached, rms_norm, rope_on, rotate_qk
from tspbench.core.memory import unrecorded
from tspbench.core.mesh import Axis, Mesh
from tspbench.core.optim import grad_sq_sum
from tspbench.core.options import Option, Value
from tspbench.core.reference import QK_NORMS, param_shapes
from tspbench.core.strategy import Batch, Layout, Strategy

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

SEQUENCE_PARALLEL = Option(
    "sequence_parallel",
    False,
    "tp_torch: Megatron's sequence parallelism between the projections (torch's "
    "SequenceParallel norms; reduce-scatter and all-gather in place of each all-reduce)",
    tag="-seqpar-{value}",
    label=" (seq-par {value})",
)

# reference name (a layer's part after "layers.i.") -> the module path of its tensor
_LAYER_PATHS = {
    "attn_norm": "attn_norm.weight", "mlp_norm": "mlp_norm.weight",
    "wq": "attention.wq.weight", "wk": "attention.wk.weight", "wv": "attention.wv.weight",
    "wo": "attention.wo.weight", "bq": "attention.wq.bias", "bk": "attention.wk.bias",
    "bv": "attention.wv.bias", "bo": "attention.wo.bias", "q_norm": "attention.q_norm.weight",
    "k_norm": "attention.k_norm.weight", "w1": "mlp.w1.weight", "w3": "mlp.w3.weight",
    "w2": "mlp.w2.weight", "b1": "mlp.w1.bias", "b3": "mlp.w3.bias", "b2": "mlp.w2.bias",
}  # fmt: skip


def module_path(name: str) -> str:
    """The parameter path in :class:`Model` of a reference-named parameter."""
    if name.startswith("layers."):
        _, i, part = name.split(".")
        return f"layers.{i}.{_LAYER_PATHS[part]}"
    return f"{name}.weight"


def _tp_api():
    """torch's tensor-parallel package (``parallelize_module``, the styles, ``loss_parallel``):
    imported when a tp_torch model is built or checked, not when the registry loads."""
    import torch.distributed.tensor.parallel as tp

    return tp


# the functional collectives :class:`Counted` does not run (DTensor's TP plan issues none)
_UNCOUNTED = {
    "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "all_gather_into_tensor_out",
    "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "all_to_all_single",
    "broadcast", "broadcast_",
}  # fmt: skip


class Counted(TorchDispatchMode):
    """DTensor's functional collectives run through the counted ``comm`` (waited for when
    issued: gloo has no streams to overlap them on); any other collective stops the run."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor's own dispatch first: its collectives come back here
        c10d = torch.ops._c10d_functional
        if func is c10d.all_reduce.default:
            t, op, _ = args
            out = t.clone()  # functional: a new tensor, as the op returns
            self.comm.all_reduce(out, op=_reduce_op(op))
            return out
        if func is c10d.all_gather_into_tensor.default:
            return self.comm.all_gather(args[0], dim=0)
        if func is c10d.reduce_scatter_tensor.default:
            t, op, _, _ = args
            _reduce_op(op, sum_only=True)
            return self.comm.reduce_scatter(t, dim=0)
        if func is c10d.wait_tensor.default:
            return args[0]  # every collective above is done when it returns
        if func.namespace == "_c10d_functional" and func._opname in _UNCOUNTED:
            raise RuntimeError(f"tp_torch: DTensor issued {func}, which the counter does not run")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _metadata_unrecorded() -> Iterator[None]:
    """DTensor learns an op's output shape by running it on fake tensors of the *global* shape
    (its sharding propagator; on every call under fake tensors, once per shape otherwise): no
    rank ever holds them, so the memory tracker must not count them (they added 19% to the
    forward-only first step at tiny, S = 2048, D = 4: the log-softmax of the full logits)."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    propagate = getattr(prop, "_propagate_tensor_meta_non_cached", None)
    if propagate is None:  # a torch without this private method: counted as it runs
        yield
        return

    def unrecorded_propagate(op_schema):
        with unrecorded():
            return propagate(op_schema)

    # on this instance, for the step
    prop._propagate_tensor_meta_non_cached = unrecorded_propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        del prop._propagate_tensor_meta_non_cached


def _reduce_op(op: str, sum_only: bool = False) -> dist.ReduceOp.RedOpType:
    ops = {"sum": dist.ReduceOp.SUM} if sum_only else {"sum": dist.ReduceOp.SUM,
                                                         "max": dist.ReduceOp.MAX}  # fmt: skip
    if op.lower() not in ops:
        raise RuntimeError(f"tp_torch: DTensor asked for reduce op {op!r}")
    return ops[op.lower()]


class Norm(nn.Module):
    """RMSNorm over the last dim, the suite's kernel (fp32 inside, as the reference's)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(cfg: ModelConfig, name: str, dtype: torch.dtype, bias: bool) -> nn.Linear:
    rows, cols = param_shapes(cfg)[f"layers.0.{name}"]
    return nn.Linear(cols, rows, bias=bias, dtype=dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq = _linear(cfg, "wq", dtype, cfg.qkv_bias)
        self.wk = _linear(cfg, "wk", dtype, cfg.qkv_bias)
        self.wv = _linear(cfg, "wv", dtype, cfg.qkv_bias)
        self.wo = _linear(cfg, "wo", dtype, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = Norm(cfg.d_head, cfg.norm_eps, dtype)
            self.k_norm = Norm(cfg.d_head, cfg.norm_eps, dtype)

    def forward(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Every token's attention on this rank's heads (``a``: the whole normed input)."""
        cfg = self.cfg

        def heads(t: torch.Tensor) -> torch.Tensor:  # the local heads: wq's rows on this rank
            return t.view(*t.shape[:2], -1, cfg.d_head).transpose(1, 2)

        norms: dict[str, torch.Tensor] = {}
        if cfg.qk_norm:
            norms = {"q_norm": self.q_norm.weight, "k_norm": self.k_norm.weight}
        q, k = rotate_qk(heads(self.wq(a)), heads(self.wk(a)), norms, cfg.norm_eps, cos, sin)
        o = attention(q, k, heads(self.wv(a)))
        return self.wo(o.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = _linear(cfg, "w1", dtype, cfg.mlp_bias)
        self.w3 = _linear(cfg, "w3", dtype, cfg.mlp_bias)
        self.w2 = _linear(cfg, "w2", dtype, cfg.mlp_bias)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(m)) * self.w3(m))


class Block(nn.Module):
    """One pre-norm Llama block, the reference's ``transformer_layer`` as modules."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.attn_norm = Norm(cfg.hidden, cfg.norm_eps, dtype)
        self.attention = Attention(cfg, dtype)
        self.mlp_norm = Norm(cfg.hidden, cfg.norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, dtype) for _ in range(cfg.layers))
        self.norm = Norm(cfg.hidden, cfg.norm_eps, dtype)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=dtype)


def _plan(cfg: ModelConfig, seq_par: bool) -> dict[str, object]:
    """torchtitan's Llama TP plan (``apply_tp``), with or without its sequence parallelism."""
    from torch.distributed.tensor import Replicate, Shard

    tp = _tp_api()
    Colwise, Rowwise, PrepareInput, SeqPar = (
        tp.ColwiseParallel,
        tp.RowwiseParallel,
        tp.PrepareModuleInput,
        tp.SequenceParallel,
    )
    between = Shard(1) if seq_par else Replicate()  # the activations between the projections
    plan: dict[str, object] = {
        "embed": Rowwise(input_layouts=Replicate(), output_layouts=between),
        "head": Colwise(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    if seq_par:
        plan["norm"] = SeqPar()
    for i in range(cfg.layers):
        block = {
            "attention": PrepareInput(
                input_layouts=(between, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": Colwise(),
            "attention.wk": Colwise(),
            "attention.wv": Colwise(),
            "attention.wo": Rowwise(output_layouts=between),
            "mlp": PrepareInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "mlp.w1": Colwise(),
            "mlp.w3": Colwise(),
            "mlp.w2": Rowwise(output_layouts=between),
        }
        if seq_par:
            block |= {"attn_norm": SeqPar(), "mlp_norm": SeqPar()}
        plan |= {f"layers.{i}.{k}": v for k, v in block.items()}
    return plan


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Every meta parameter (a DTensor: its local shard) made uninitialised on ``device``, as a
    new parameter: ``Module.to_empty`` would swap tensors where the types differ (meta and fake
    tensors under the estimator), which a tracked tensor's weak reference forbids."""
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = nn.Parameter(torch.empty_like(p, device=device))


def _is_dtensor(t: torch.Tensor | None) -> TypeGuard[DTensor]:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _shard_dim(p: torch.Tensor) -> int | None:
    """The dim a parameter is split along over the group, or None (whole on every rank)."""
    from torch.distributed.tensor import Shard

    if not _is_dtensor(p):
        return None
    dims = [pl.dim for pl in p.placements if isinstance(pl, Shard)]
    return dims[0] if dims else None


class TPTorch(Strategy):
    name = "tp_torch"
    display = "TP (torch)"  # legends, titles and tables' captions
    options = (SEQUENCE_PARALLEL,)
    sequence_parallel: bool
    implements = "tp"  # the layout it runs, in torch's code (see Strategy.implements)
    costs = TPTorchCosts()
    decoder = None  # no decode path: torch's TP is measured in training and the forward

    @classmethod
    def validate(
        cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **options: Value
    ) -> None:
        super().validate(cfg, layout, seq_len, batch)
        for field in ("heads", "kv_heads", "ffn", "vocab"):
            cls.require_divisible(f"model.{field}", getattr(cfg, field), layout.degree, "T")
        if options.get("sequence_parallel"):
            cls.require_divisible("seq_len", seq_len, layout.degree, "T (sequence_parallel)")

    def __init__(self, cfg: ModelConfig, mesh: Mesh, **kw) -> None:
        super().__init__(cfg, mesh, **kw)
        self.comm = mesh[Axis.MODEL]
        self.parallel = self.comm.size > 1  # one rank: the plain modules move nothing
        with torch.device("meta" if self.parallel else self.device):  # (meta: shards later)
            self.model = Model(cfg, self.dtype)
        if self.parallel:
            self._parallelize()
            _materialize(self.model, self.device)
        if cfg.tie_embeddings:  # both split by vocabulary rows (Shard(0)): one DTensor serves
            self.model.head.weight = self.model.embed.weight
        T, r = self.comm.size, self.comm.rank
        shapes = param_shapes(cfg)
        modules = dict(self.model.named_parameters())
        self.names = list(shapes)
        # (the module's parameter, the optimizer's alias of this rank's shard of it)
        self._shards: list[tuple[nn.Parameter, nn.Parameter]] = []
        self._dims: list[int | None] = []  # each one's split dim over the group (None: whole)
        with torch.no_grad():
            for name in self.names:
                p = modules[module_path(name)]
                dim = _shard_dim(p)
                blocks: list[slice | None] = [None, None]
                if dim is not None:
                    blocks[dim] = chunk_slice(shapes[name][dim], T, r)
                local = p.to_local() if _is_dtensor(p) else p
                local.copy_(self.init_block(name, *blocks))
                self._shards.append((p, nn.Parameter(local) if _is_dtensor(p) else p))
                self._dims.append(dim)

    def _parallelize(self) -> None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import DeviceMesh

        assert self.comm.group is not None  # D > 1: the model group has a process group
        with unset_fake_temporarily():  # the mesh's rank table is real even on fake tensors
            device_mesh = DeviceMesh.from_group(self.comm.group, self.device.type)
        _tp_api().parallelize_module(
            self.model, device_mesh, _plan(self.cfg, self.sequence_parallel)
        )

    @contextlib.contextmanager
    def _torch_tp(self) -> Iterator[None]:
        """DTensor's collectives through the counted comm, its cross-entropy vocabulary-parallel."""
        if not self.parallel:
            yield
            return
        with Counted(self.comm), _tp_api().loss_parallel(), _metadata_unrecorded():
            yield

    # -- the model ------------------------------------------------------------------------------
    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        return Batch(
            self.dp_slice(tokens).to(self.device),
            self.dp_slice(labels).to(self.device),
            tokens.numel(),
        )

    def _hidden(self, batch: Batch) -> torch.Tensor:
        """The final norm's output: every token, or (sequence parallel) this rank's S/T."""
        cfg, m = self.cfg, self.model
        x = m.embed(batch.tokens)
        L = batch.tokens.shape[1]
        cos, sin = cached(self, ("rope", L, self.dtype), lambda: rope_on(torch.arange(L), cfg, x))
        for block in m.layers:
            x = self.checkpointed(block, x, cos, sin)
        return m.norm(x)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.head(self._hidden(batch)).float()
        local = (
            F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum")
            / batch.n_tokens
        )
        whole = local.to_local() if _is_dtensor(local) else local  # replicated: every rank's
        return local, self.total_loss(whole, token_axes=())

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        with self._torch_tp():
            return super().forward_backward(batch)

    @torch.no_grad()
    def forward_only(self, batch: Batch) -> torch.Tensor:
        with self._torch_tp():
            return self.loss(batch)[1]

    def finish_grads(self) -> None:
        """Each shard's gradient to its optimizer alias, in the parameter's own placement: a
        replicated parameter used on sequence shards (the norms under sequence parallelism)
        holds partial sums until reduced (DTensor redistributes them, counted). Qwen3's QK
        norms, plain parameters on this rank's heads, are summed over the group as TP's are."""
        for p, shard in self._shards:
            g = p.grad
            if _is_dtensor(g) and _is_dtensor(p):
                if g.placements != p.placements:
                    g = g.redistribute(p.device_mesh, p.placements)
                shard.grad = g.to_local()
                p.grad = None
        if self.parallel:
            qk = [s for n, (_, s) in zip(self.names, self._shards) if n.endswith(QK_NORMS)]
            self.all_reduce_grads(qk, self.comm)
        super().finish_grads()

    def parameters(self) -> list[nn.Parameter]:
        return [shard for _, shard in self._shards]

    def grad_sq_norm(self) -> torch.Tensor:
        shards = self.parameters()
        sharded = [s for s, dim in zip(shards, self._dims) if dim is not None]
        whole = [s for s, dim in zip(shards, self._dims) if dim is None]
        return self.comm.all_reduce_metric(grad_sq_sum(sharded)) + grad_sq_sum(whole)

    def hidden(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad(), self._torch_tp():
            h = self._hidden(batch)
            return h.full_tensor() if _is_dtensor(h) else h  # (sequence parallel: a shard)

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for name, (_, shard), dim in zip(self.names, self._shards, self._dims):
            t = shard.grad if grads else shard
            assert t is not None, f"{name}: no gradient (gather grads after the backward)"
            out[name] = t.detach() if dim is None else self.comm.all_gather(t.detach(), dim=dim)
        return out
