"""The compute dtypes a run may name, in one place: the command line's ``--dtype`` choices, the
tensors' torch dtypes and their bytes per element (what the closed forms count)."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BYTES = {name: dt.itemsize for name, dt in DTYPES.items()}  # fp32: 4, bf16: 2
