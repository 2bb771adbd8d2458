"""Expert parallelism's all-to-all dispatcher, shared by every strategy whose experts are split
over a group that also splits the tokens (TSP's ``all_to_all`` schedule, FSDP+CP's experts).

Rank p of the group owns experts p E/D .. (p+1) E/D - 1 and routes its own tokens. The
per-expert counts are exchanged (one even all-to-all), then each (token, slot) row goes to its
expert's owner (dispatch: one uneven all-to-all), the owner applies its experts, and the rows
come back (combine) to be weighted and summed per token. This is Megatron-Core's and
torchtitan's all-to-all token dispatcher, dropless: no capacity, no padding to a multiple of
an alignment (torchtitan pads each expert's rows for its grouped GEMM; here each expert is one
plain GEMM on its rows). Autograd runs through the two exchanges (:class:`AllToAllV`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tspbench.core.comm import Comm
from tspbench.core.moe import even_counts, expert_counts, is_balanced


class AllToAllV(torch.autograd.Function):
    """Rows to their ranks (``send[j]`` to rank j, ``recv[j]`` back from it); backward sends
    the rows' gradients the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], comm: Comm):
        ctx.send, ctx.recv, ctx.comm = send, recv, comm
        return comm.all_to_all_v(x, send, recv)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return ctx.comm.all_to_all_v(dy, ctx.recv, ctx.send), None, None, None


def dispatch_combine(
    m: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    comm: Comm,
    experts: int,
    apply: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum over each local token's k experts of weight x expert(token) for the tokens m [t, h]
    routed to ``idx`` [t, k] with ``weights`` [t, k]: the rows dispatched to the experts'
    owners over ``comm``, ``apply(j, rows)`` run there by local expert j (every one, on no
    rows where none came: its gradient is zeros, not missing), and combined back. Under
    :func:`tspbench.core.moe.balanced` routing the split sizes are taken from this rank's
    shape: every rank of ``comm`` must hold as many tokens (TSP's and FSDP+CP's zigzag
    chunks do; pipelines and decode refuse experts)."""
    D, per = comm.size, experts // comm.size
    flat = idx.flatten()  # (token, slot) pairs, token-major
    order = torch.argsort(flat, stable=True)  # by expert, hence by owner
    counts = expert_counts(idx, experts).view(D, per)
    mine = comm.all_to_all(counts)  # [D, per]: rows for my experts, from each rank
    if is_balanced():  # every rank of the group routes as many tokens alike: known here
        t, k = idx.shape
        even = even_counts(t, k, experts)
        sent = [even[r * per : (r + 1) * per] for r in range(D)]
        got = [even[comm.rank * per : (comm.rank + 1) * per]] * D
    else:
        sent, got = torch.stack([counts, mine]).tolist()  # the split sizes: one host sync
    send, recv = [sum(r) for r in sent], [sum(r) for r in got]
    rows = AllToAllV.apply(m[order // idx.shape[1]], send, recv, comm)
    # the received rows: rank 0's block (by expert), then rank 1's, ...; each expert's together
    local = torch.arange(per, device=m.device).repeat(D)
    local = torch.repeat_interleave(local, mine.flatten(), output_size=sum(recv))
    by_expert = torch.argsort(local, stable=True)
    sizes = [sum(r[j] for r in got) for j in range(per)]
    outs = [apply(j, x) for j, x in enumerate(rows[by_expert].split(sizes))]
    y = torch.empty_like(rows).index_copy(0, by_expert, torch.cat(outs))
    back = AllToAllV.apply(y, recv, send, comm)  # in the dispatched order
    scaled = back * weights.flatten()[order, None]
    return torch.zeros_like(m).index_add(0, order // idx.shape[1], scaled)
