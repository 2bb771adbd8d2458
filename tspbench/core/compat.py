"""Every torch call whose name or presence depends on the torch version, in one place.

GPU sites bring their own CUDA/ROCm build of torch (a current H200 image ships 2.11), so the
suite runs on every torch from :data:`TORCH_FLOOR` on, not only on the CPU pin (2.13). torch 2.13
added ``all_gather_single`` / ``reduce_scatter_single`` and deprecated the ``*_into_tensor`` /
``*_tensor`` names that every earlier release has: the flat collectives below take whichever
this torch has. ``tests/unit/test_compat.py`` runs the collectives with the new names hidden,
and ``docs/running.md`` says how the oldest supported torch was checked.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from tspbench.core.config import ConfigError

TORCH_FLOOR = (2, 11)  # the oldest torch every strategy was checked on (docs/running.md)


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.11.0+cu130`` or ``2.6.0a0+ecf3bae``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ConfigError(f"torch version {version!r}: not a release number")
    return int(m.group(1)), int(m.group(2))


def require_torch(version: str | None = None) -> None:
    """Refuse, in one line, a torch older than the floor (before any rank starts)."""
    version = version or str(torch.__version__)
    if torch_release(version) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ConfigError(
            f"torch {version}: tspbench needs torch >= {floor} (the oldest release its "
            "strategies were checked on); install a newer CUDA/ROCm/CPU build"
        )


def all_gather_flat(out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's 1-D ``t`` concatenated into the 1-D ``out``, in group-rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, t, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False):
    """Sum of every rank's 1-D ``t``, block ``rank`` of ``size`` equal blocks into ``out``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, t, group=group, async_op=async_op)


def all_to_all_flat(
    out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False, **splits
):
    """Block j of ``size`` equal blocks of ``t`` to group-rank j; block j of ``out`` from
    group-rank j (``splits``: ``output_split_sizes`` and ``input_split_sizes``, rows of dim 0,
    for uneven blocks; ``all_to_all_single``: the same name from torch 2.11 to 2.13)."""
    return dist.all_to_all_single(out, t, group=group, async_op=async_op, **splits)
