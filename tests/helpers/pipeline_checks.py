"""Rank-side checks of pipelined runs (tests/integration/test_pipeline_parallel.py): each rank
builds its stage through the runtime's own path (:func:`tspbench.runtime.measure.build_strategy`)
and compares the loss, the gradient norm, every gradient its stage holds and its weights after
three AdamW steps with the single-device reference's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers.checks import LR, case_spec, close, err
from tspbench.core.dtypes import DTYPES
from tspbench.core.memory import MemoryTracker
from tspbench.core.mesh import build_mesh
from tspbench.core.optim import AdamW
from tspbench.core.reference import ReferenceModel, make_batch
from tspbench.runtime.measure import at_rest, build_strategy, one_step

# what FSDP+CP's stage holds only within a step (kept units, their summed gradients, gathers
# and reduce-scatters in flight): empty after every step
CARRIED = ("kept", "full_grads", "prefetched", "regathered", "reducing", "held")


def check_pipelined(case: dict) -> dict:
    spec = case_spec(case, pp=case["pp"], pp_schedule=case["schedule"], microbatches=case["M"])
    mesh = build_mesh(spec.mesh_dims)
    strat = build_strategy(spec, mesh, torch.device("cpu"))
    cfg, rtol = spec.cfg, 1e-4
    tokens, labels = make_batch(cfg, spec.batch * spec.layout.dp, spec.seq_len, spec.seed)
    ref = ReferenceModel(cfg, seed=spec.seed, dtype=DTYPES[spec.dtype])
    ref_opt, opt = AdamW(list(ref.parameters())), AdamW(strat.parameters())
    res: dict = {"errors": {}, "ok": True, "stage": strat.stage.index}

    def record(name: str, a: torch.Tensor, b: torch.Tensor, atol: float | None = None) -> None:
        res["errors"][name] = err(a, b)
        if not close(a, b, rtol, atol):
            res["ok"] = False
            res.setdefault("failed", []).append(name)

    batch = strat.shard_batch(tokens, labels)
    res["numel"] = strat.local_numel()
    if spec.mode == "infer":  # the forward alone: the merged outputs' loss on the last stage
        record("loss", strat.forward_only(batch), ref.loss(tokens, labels)[0])
        return res
    for step in range(3):
        ref_loss, _ = ref.loss(tokens, labels)
        ref_loss.backward()
        loss = strat.forward_backward(batch)
        # every step's loss and gradient norm (state a stage wrongly carries from one step to
        # the next, kept units or gradients, shows from the second), and nothing carried
        record(f"loss{step}", loss, ref_loss)
        ref_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters()))
        record(f"grad_norm{step}", strat.grad_sq_norm().sqrt(), ref_norm)
        for name in CARRIED:  # (on each of the rank's stages)
            if any(getattr(s, name, None) for s in strat.strats):
                res["ok"] = False
                res.setdefault("failed", []).append(f"step {step}: {name} not empty")
        if step == 0:
            res["times"] = strat.take_times()  # (schedule, stage compute) seconds
            ref_grads = {n: p.grad for n, p in ref.named_full_params().items()}
            held = strat.full_params(grads=True)
            res["names"] = sorted(held)
            for n, g in held.items():
                record(f"grad:{n}", g, ref_grads[n])
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    full = ref.named_full_params()
    for n, w in strat.full_params().items():  # (checks.check_equal says why this atol)
        record(f"step3:{n}", w, full[n], atol=0.1 * LR)
    res["ref_names"] = sorted(full)
    res["pp_bytes"] = mesh.counter.by_axis().get("pp", 0.0)
    # weight passes a zero-bubble schedule deferred (TSP's own split; torch's keeps no count)
    passes = [s.weight_pass for s in strat.strats if getattr(s, "weight_pass", None)]
    res["deferred"] = sum(p.ran for p in passes)
    res["most_pending"] = max((p.most_pending for p in passes), default=0)
    return res


def run_pipelined(cases: list[dict]) -> dict:
    return {c["id"]: check_pipelined(c) for c in cases}


def held_sends(case: dict) -> dict:
    """This rank's tracked peak of a training step as torch's schedule runs it, and of the same
    step with every send waited for as soon as it is posted (its work, and the tensor it holds,
    dropped at once): what torch's multi-stage runtime keeps of its sends to the step's end."""
    from torch.distributed.pipelining import schedules

    spec = case_spec(case, pp=case["pp"], pp_schedule=case["schedule"], microbatches=case["M"])
    strat = build_strategy(spec, build_mesh(spec.mesh_dims), torch.device("cpu"))
    tokens, labels = make_batch(spec.cfg, spec.batch, spec.seq_len, spec.seed)
    batch = strat.shard_batch(tokens, labels)
    opt = AdamW(strat.parameters())
    tracker = MemoryTracker()
    tracker.track(*at_rest(strat, batch, opt))
    posted = schedules._batch_p2p

    def waited(ops: list, desc: str | None = None) -> list:
        works = posted(ops, desc)
        if all(op.op is dist.isend for op in ops):
            schedules._wait_batch_p2p(works)
            return []
        return works

    peaks = []
    for eager in (False, False, True):  # (the first step makes AdamW's state)
        schedules._batch_p2p = waited if eager else posted
        try:
            tracker.reset_peak()
            with tracker:
                one_step(strat, batch, opt)
        finally:
            schedules._batch_p2p = posted
        peaks.append(tracker.peak)
    return {"stage": strat.stage.index, "held": peaks[1], "waited": peaks[2]}


def run_held_sends(cases: list[dict]) -> dict:
    return {c["id"]: held_sends(c) for c in cases}
