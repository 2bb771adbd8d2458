"""Pipelines in closed form: what one stage holds and how much of it a schedule keeps.

A pipelined run (``layout.pp`` stages; :mod:`tspbench.runtime.pipelined`) splits the layers into
``pp`` equal blocks, the embedding on the first stage and the final norm and LM head on the last
(:class:`tspbench.core.stage.Stage`), and the replica's batch B into M micro-batches of b = B/M
rows. The work of a stage on one micro-batch is the work of a model of L/pp layers on batch b
(:func:`micro_spec`): the cost model times it (the slowest stage, the last, is such a model:
the embedding is a lookup) and the memory model prices its activations. What a stage holds
(:func:`stage_params`) is exact: the strategy's closed form split by layers and tables.

Activations in flight (Narayanan et al., 2021; torch.distributed.pipelining's schedules): GPipe
runs every micro-batch's forward before any backward, so each stage keeps M micro-batches'
activations; 1F1B starts a micro-batch's backward as soon as the last stage can, so stage s
keeps at most pp - s (the first stage pp, the last one). Interleaved 1F1B runs v stages of
L/(pp v) layers on each rank (rank r: stages r, r + pp, ...) and counts in chunks (one such stage
on one micro-batch): rank r runs min((v - 1) m + 2 (pp - 1 - r), v M) forwards before its first
backward, m = M / max(1, M // pp) micro-batches a round (torch's ``_get_warmup_ops``), then
alternates, so it keeps one chunk more than that. Here ``stage`` is a rank's position in the
pipeline, whatever the number of stages it runs.
"""

from __future__ import annotations

import dataclasses
import functools

from tspbench.core.config import ModelConfig
from tspbench.core.layout import Layout
from tspbench.core.strategy import Strategy
from tspbench.projection import analytic
from tspbench.projection.analytic import Memory
from tspbench.runtime.pipelined import check_projected, stages_per_rank
from tspbench.runtime.spec import RunSpec


@functools.lru_cache(maxsize=4096)
def micro_spec(c: RunSpec) -> RunSpec:
    """One stage's work on one micro-batch (a chunk) as a whole-model case: L/(pp v) layers,
    batch B/M, no pipeline axis, the same replicas (it keeps the embedding and the head, as the
    last stage does with its head)."""
    pp = c.layout.pp * stages_per_rank(c.pp_schedule)
    cfg = dataclasses.replace(c.cfg, layers=c.cfg.layers // pp)
    lay = dataclasses.replace(c.layout, pp=1)
    return c.replace(
        cfg=cfg, layout=lay, batch=c.batch // c.microbatches, microbatches=0, stage_of=pp
    )


def stage_params(c: RunSpec, stage: int) -> int:
    """Parameter elements one rank of stage ``stage`` holds: its L/pp layers, the embedding on
    the first stage, the final norm and the head on the last (the strategy's closed form, split
    by its per-layer part and its two vocabulary tables, each linear in the vocabulary); with
    tied embeddings the one table on the first stage and its copy, the head, on the last."""
    cfg, pp = c.cfg, c.layout.pp
    per_layer, tables, norm = _parts(c.impl, cfg, _unstaged(c.layout))
    n = cfg.layers // pp * per_layer
    first = table_params(c)  # (tied: the model's one table)
    if stage == 0:
        n += first
    if stage == pp - 1:  # (tied: the copy, but on a whole model's one stage)
        n += (first * (pp > 1) if cfg.tie_embeddings else tables - first) + norm
    return n


def table_params(c: RunSpec) -> int:
    """Elements of one vocabulary table on a rank: with tied embeddings, what the first and
    the last stage each hold of the embedding, whose gradients they sum every step."""
    _, tables, _ = _parts(c.impl, c.cfg, _unstaged(c.layout))
    return tables if c.cfg.tie_embeddings else tables // 2


@functools.lru_cache(maxsize=1024)
def _unstaged(lay: Layout) -> Layout:
    return dataclasses.replace(lay, pp=1)


@functools.lru_cache(maxsize=1024)
def _parts(impl: type[Strategy], cfg: ModelConfig, lay: Layout) -> tuple[int, int, int]:
    """(one layer's, both vocabulary tables', the final norm's) parameter elements on a rank."""

    def numel(layers: int, vocab: int) -> int:
        return impl.costs.param_numel(dataclasses.replace(cfg, layers=layers, vocab=vocab), lay)

    one = numel(1, cfg.vocab)
    per_layer = numel(2, cfg.vocab) - one
    tables = numel(1, 2 * cfg.vocab) - one  # embedding and head together
    return per_layer, tables, one - per_layer - tables


def in_flight(c: RunSpec, stage: int) -> int:
    """Chunks (one stage's layers on one micro-batch) whose activations the rank at pipeline
    position ``stage`` keeps at once (module docstring)."""
    M, pp, v = c.microbatches, c.layout.pp, stages_per_rank(c.pp_schedule)
    if c.pp_schedule == "gpipe":
        return M
    per_round = M // max(1, M // pp)
    return (
        min((v - 1) * per_round + 2 * (pp - 1 - stage) + 1, v * M) if v > 1 else min(pp - stage, M)
    )


def sends_held(c: RunSpec, stage: int, done: int) -> int:
    """Activations the rank at pipeline position ``stage`` has sent and torch still holds after
    its first ``done`` backward chunks, under a schedule of several stages per rank: torch's
    multi-stage runtime (``_PipelineScheduleRuntime``) waits for its sends only when the step
    ends, and a send's work holds its tensor until waited for (gloo's; NCCL's stash is cleared
    at the wait), so each chunk's output, sent forward, outlives the chunk's backward, and each
    gradient sent back lives to the step's end. A rank runs its backwards in rounds of ``m``
    micro-batches per stage, its last stage first (torch's order of actions); a chunk sends an
    output unless it is the pipeline's last stage, a gradient unless it is the first.
    GPipe and 1F1B run one stage and wait for their sends (GPipe's gradients at the end of its
    backwards, at most one a crest later: not counted)."""
    v = stages_per_rank(c.pp_schedule)
    return 0 if v == 1 else _held(c.layout.pp, c.microbatches, v, stage, done)


@functools.lru_cache(maxsize=4096)
def _held(pp: int, M: int, v: int, stage: int, done: int) -> int:
    m = M // max(1, M // pp)
    held = 0
    for j in range(done):
        g = stage + (v - 1 - (j // m) % v) * pp  # the global stage of the rank's j-th backward
        held += (g != pp * v - 1) + (g != 0)
    return held


def stage_memory(c: RunSpec, stage: int) -> Memory:
    """Bytes per rank of stage ``stage`` by part, and its peaks: :func:`analytic.memory`'s
    crests with the stage's parameters and its micro-batches in flight. The loss's crest is the
    last stage's alone. The transients are one micro-batch's, taken from the stage's model
    (:func:`micro_spec`), which holds both vocabulary tables: where a strategy's transient
    scales with a table (TSP's embedding gradient at the end of backward, a baseline's packed
    gradient copy) a stage without it is over-estimated by that table's share."""
    check_projected(c.pp_schedule)
    mb, impl = micro_spec(c), c.impl
    cfg, e, t = c.cfg, c.e, mb.tokens
    last, n = stage == c.layout.pp - 1, stage_params(c, stage)
    act = t * cfg.hidden * e  # one micro-batch's [t, h] activation
    weights, masters = n * e, (4 * n if c.train and e != 4 else 0)
    rest = weights + masters + 16 * c.tokens  # + the replica's int64 tokens and labels
    # what the strategy keeps over the micro-batches (FSDP+CP's gathered units and their
    # full gradients): the weights to the schedule's end, the gradients to their reduction
    kept_w, kept_g = impl.costs.stage_held(c, n)
    parts: Memory = {
        "weights": weights,
        "master_weights": masters,
        "grads": n * e if c.train else 0,
        "optimizer": 8 * n if c.train else 0,
    }
    if not c.train:  # one micro-batch at a time; the last stage keeps every micro-batch's
        # output until the schedule merges them
        layer, loss_work = impl.costs.inference_working_set(mb)
        work = max(layer, loss_work) if last else layer
        outputs = c.microbatches * act * (1 + (stage > 0)) if last else 0
        parts.update({"saved_activations": outputs, "transient": work, "peak_at": "inference"})
        parts["peak_first"] = parts["peak"] = rest + kept_w + outputs + work
        return parts
    # each of torch's stages keeps a receive buffer per micro-batch: activations from the
    # previous stage, and in training their gradients from the next (a rank's v stages: all but
    # the pipeline's first and last)
    v = stages_per_rank(c.pp_schedule)
    bufs = c.microbatches * act * ((v - (stage == 0)) + c.train * (v - last))
    k = in_flight(c, stage)
    kl = min(k, 1) if v > 1 else k  # micro-batches with the loss's tensors (on the last rank)
    # the first backward finds k micro-batches in flight and no gradient yet; a later one
    # finds every gradient of the stage beside k (1F1B's steady state) or k - 1 in flight
    later = k if c.pp_schedule != "gpipe" and v * c.microbatches > k else k - 1
    # sent activations torch holds to the step's end (multi-stage schedules): at the last
    # backward that finds ``later`` chunks in flight (the steady crest: v M - k done before it;
    # each later one finds a chunk fewer and at most two more sent, or the second backward) and
    # at the last backward
    sent = sends_held(c, stage, v * c.microbatches - k if later == k else 1) * act
    sent_end = sends_held(c, stage, v * c.microbatches - 1) * act
    per_layer = analytic.saved_per_layer(mb)
    unit = mb.cfg.layers * (act if c.rc else per_layer)  # one chunk's saved layers
    # and its output, which torch's stage keeps for the chunk's backward (its ``fwd_cache``),
    # but on the pipeline's last stage, whose output the final norm saves (in loss_unit)
    loss_unit = analytic.saved_loss(mb) if last else 0
    # (kept gradients are summed in full, the shards' assigned only after the schedule)
    grads = (kept_g or n * e) if c.microbatches > 1 else 0
    head_grad = cfg.vocab // impl.costs.weight_split(c.layout) * cfg.hidden * e if last else 0
    loss_t, layer_t, end_t = impl.costs.backward_transients(mb)
    top = per_layer - act if c.rc else 0
    rest += bufs

    def held(at_loss: bool) -> int:
        """Saved tensors at a backward: the loss's saved tensors of the micro-batch in
        backward too at the loss, only the others' at a layer."""
        first = k * unit + (kl - (not at_loss)) * loss_unit + chunk_outputs(k, kl)
        if c.microbatches == 1:  # (kept gradients fill during the one backward: all, at most)
            first += kept_g
        lk = min(later, kl)
        again = later * unit + (lk - (not at_loss)) * loss_unit + chunk_outputs(later, lk)
        again += grads + sent
        return max(first, again if later else 0)

    def chunk_outputs(chunks: int, at_last: int) -> int:
        """The outputs torch keeps of ``chunks`` in flight, ``at_last`` of them the last
        stage's (whose output is in loss_unit)."""
        return (chunks - (at_last if last else 0)) * act

    crests = {
        "layer backward": rest + kept_w + held(False) + top + layer_t + head_grad,
        # (kept units: their weights until the schedule ends, their full gradients until
        # reduce-scattered after it; else the shards' gradients)
        "end of backward": rest + end_t + (kept_w + kept_g if kept_g else n * e) + sent_end,
    }
    if last:
        crests["loss backward"] = rest + kept_w + held(True) + loss_t + head_grad
    if c.cfg.tie_embeddings and (stage == 0 or last):  # the two ends' all-reduce after the
        # schedule: the shards' gradients and the table's gradient packed beside them
        crests["tied all-reduce"] = rest + n * e + table_params(c) * e
    layers = k * unit + kl * loss_unit + chunk_outputs(k, kl)
    opt = rest + n * e + 8 * n + (4 * n if e != 4 else 0)
    at = max(crests, key=lambda x: crests[x])
    parts.update({"saved_activations": layers, "transient": crests[at] - rest - layers})
    steady = max(crests[at] + 8 * n, opt)
    parts.update({"peak_first": max(crests[at], opt), "peak": steady})
    parts["peak_at"] = at if steady > opt else "optimizer step"
    return parts


def memory(c: RunSpec) -> tuple[int, Memory]:
    """(the stage whose peak is highest, its :func:`stage_memory`): the cap a pipeline must fit
    is its fullest stage's. Only the first, the second and the last are priced: the others
    hold what the second holds (no table, both receive buffers) with as many micro-batches in
    flight or fewer (under interleaved 1F1B two chunks fewer per rank, at least four
    activations, for at most four more sends held: :func:`sends_held`)."""
    pp = c.layout.pp
    peaks = {s: stage_memory(c, s) for s in sorted({0, min(1, pp - 1), pp - 1})}
    s = max(peaks, key=lambda i: peaks[i]["peak"])
    return s, peaks[s]
