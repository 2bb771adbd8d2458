"""TP (torch)'s closed forms per rank: DTensor's collectives for torchtitan's Llama plan over the
D ranks, GEMM weights split D ways (the plain layer's memory otherwise, tspbench/core/costs.py).

Without sequence parallelism the plan issues Megatron TP's collectives exactly (one reduction of
each block input's gradient, as ``PrepareModuleInput`` hands the three projections one DTensor;
the loss's three all-reduces from ``loss_parallel``). With it, each all-reduce of a [t, h]
activation is a reduce-scatter (the embedding, Wo, W2) or an all-gather (before the attention,
the MLP and the head), the backward mirrors them, and the replicated weights used on sequence
shards (the norms, the output biases) are all-reduced after backward."""

from __future__ import annotations

from tspbench.core import costs
from tspbench.core.config import ModelConfig
from tspbench.core.mesh import Axis
from tspbench.core.strategy import Layout


def seq_par_replicated_numel(cfg: ModelConfig) -> int:
    """Elements whose gradient each rank holds only its tokens' part of under sequence
    parallelism: every RMSNorm outside the attention (two per layer and the final one) and the
    output biases."""
    return (2 * cfg.layers + 1) * cfg.hidden + cfg.layers * costs.output_bias_numel(cfg)


def sequence_parallel(spec: costs.Spec) -> costs.Schedule:
    """Megatron's sequence parallelism as DTensor's plan issues it, one rank, one step."""
    D, L, cfg = spec.degree, spec.cfg.layers, spec.cfg
    act, ax = spec.tokens * cfg.hidden * spec.e, Axis.MODEL
    ev = costs.Schedule()
    ev.add("forward", ax, "reduce_scatter", D, act)  # the embedding's partial sums
    ev.add("forward", ax, "all_gather", D, act, 2 * L)  # before each attention and MLP
    ev.add("forward", ax, "reduce_scatter", D, act, 2 * L)  # after Wo and W2
    ev.add("forward", ax, "all_gather", D, act)  # before the LM head
    ev.add("forward", ax, "all_reduce", D, spec.tokens * costs.FP32, 3)  # max, sum-exp, target
    if spec.train:
        ev.add("backward", ax, "reduce_scatter", D, act)  # the LM head's input gradient
        if spec.rc:  # the recomputed forward stops after W2's GEMM: W2's scatter is not redone
            ev.add("backward", ax, "all_gather", D, act, 2 * L)
            ev.add("backward", ax, "reduce_scatter", D, act, L)
        ev.add("backward", ax, "all_gather", D, act, 2 * L)  # Wo's and W2's scatters, mirrored
        ev.add("backward", ax, "reduce_scatter", D, act, 2 * L)  # the input gathers, mirrored
        ev.add("backward", ax, "all_gather", D, act)  # the embedding's scatter, mirrored
        norms = [cfg.hidden] * (2 * L + 1)
        for n in norms:  # one reduction per norm weight, in finish_grads
            ev.add("backward", ax, "all_reduce", D, n * spec.e, per_step=True)
        if cfg.o_bias or cfg.mlp_bias:
            ev.add("backward", ax, "all_reduce", D, cfg.hidden * spec.e,
                   L * (cfg.o_bias + cfg.mlp_bias), per_step=True)  # fmt: skip
        if cfg.qk_norm:  # on this rank's heads, as TP's
            n = L * costs.qk_norm_numel(cfg) * spec.e
            ev.add("backward", ax, "all_reduce", D, n, per_step=True)
    return ev


class TPTorchCosts(costs.Costs):
    vocab_parallel_loss = True

    def tensor_degree(self, layout: Layout) -> int:
        return layout.degree

    def schedule(self, spec: costs.Spec) -> costs.Schedule:
        if spec.options.get("sequence_parallel"):
            return sequence_parallel(spec)
        return costs.megatron(spec, spec.degree, Axis.MODEL)

    def metric_reductions(self, layout: Layout, train: bool) -> tuple[int, int]:
        return 1, layout.degree if train else 1  # every rank holds the whole loss

    def inference_working_set(self, spec: costs.Spec) -> tuple[int, int]:
        """A forward-only step in ``nn.Module``s: the attention's locals (Q, K/V, its output) die
        when the module returns, before the MLP runs (as in TP's functions). A layer
        crests at the larger of the attention's (the block's input and normed input, Q,
        K/V, the output, Wo's output and its all-reduced copy), the MLP's gate (input, its sum
        with the attention's output and normed, three [t, f/T] buffers) and W2's (the three,
        the gate's product, W2's output and its all-reduced copy); the loss as TP's."""
        if spec.options.get("sequence_parallel"):
            return super().inference_working_set(spec)
        cfg, e, t = spec.cfg, spec.e, spec.tokens
        nh, kvl, fl, _ = costs.local_dims(cfg, spec.degree)
        act, o, kvu = t * cfg.hidden * e, t * nh * cfg.d_head * e, costs.kv_unit(spec, kvl)
        attention = 4 * act + 2 * o + kvu
        layer = max(attention, 3 * act + 3 * t * fl * e, 5 * act + t * fl * e)
        return layer, super().inference_working_set(spec)[1]

    def saved_per_layer(self, spec: costs.Spec) -> int:
        """TP's layer; under sequence parallelism the two norms keep this rank's tokens only
        (the projections keep the gathered normed inputs, as TP's do)."""
        saved = super().saved_per_layer(spec)
        if spec.options.get("sequence_parallel"):
            t, D = spec.tokens, spec.degree
            saved -= 2 * (t * spec.cfg.hidden * spec.e + 4 * t) * (D - 1) // D
        return saved
