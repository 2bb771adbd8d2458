"""What a plan keeps on disk (``~/.cache/tspbench``): operation counts per configuration
(:class:`OpsCache`) and the fake-tensor estimator's peaks (:func:`estimate_peak`), both keyed by a
digest of the step's code. Split from the planner because counting is the slow part (seconds
per configuration) and its cache is shared by ``tspbench plan``, the maps and the check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

from tspbench.projection import costmodel
from tspbench.runtime.spec import RunSpec


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """``path``, else $XDG_CACHE_HOME/tspbench, else ~/.cache/tspbench."""
    if path:
        return Path(path)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tspbench"


def code_digest() -> str:
    """A digest of the code a step runs (strategies, core, runtime's step, the estimator and the
    cost model): a cached count or estimate is reused only for the same code."""
    import baselines
    import tsp_impl
    import tspbench

    pkg = Path(tspbench.__file__).parent
    files = [
        *Path(tsp_impl.__file__).parent.glob("*.py"),
        *Path(baselines.__file__).parent.glob("*.py"),
    ]
    files += [*(pkg / "core").glob("*.py")]
    files += [pkg / "runtime" / f for f in ("measure.py", "flops.py", "spec.py", "registry.py")]
    files += [pkg / "projection" / f for f in ("estimate.py", "costmodel.py", "analytic.py")]
    import torch

    h = hashlib.sha256(torch.__version__.encode())
    for f in sorted(files):
        h.update(f"{f.parent.name}/{f.name}".encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _ops_key(key: RunSpec) -> str:
    """The disk key of a :func:`costmodel.count_key`: what the counted copy is."""
    lay = key.layout
    cfg = {k: v for k, v in dataclasses.asdict(key.cfg).items() if k != "name"}
    return json.dumps([key.strategy, cfg, lay.degree, lay.tp, lay.sp, key.mode, key.dtype,
                       key.recompute, key.kv_bucket, key.overlap, key.mlp_schedule,
                       key.kv_backward], sort_keys=True)  # fmt: skip


class OpsCache:
    """Operations per step of a configuration (``costmodel.count_ops``), kept on disk as the
    one- and two-layer counts of its shrunk copy (``costmodel.count_key``), so that every S,
    micro-batch, dp, depth and model with the same heads shares one entry."""

    def __init__(self, root: Path | None, digest: str | None = None) -> None:
        self.path = root / f"ops-{digest or code_digest()}.json" if root else None
        self.counts: dict[str, list[int]] = {}
        self.counted = self.hits = 0
        self.count_s = 0.0
        if self.path:
            self.counts = self._read()

    def _read(self) -> dict[str, list[int]]:
        """The counts on disk (an unreadable or foreign file counts as empty)."""
        try:
            data = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items()
                if isinstance(v, list) and len(v) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) for n in v)}  # fmt: skip

    def get(self, spec: RunSpec) -> int:
        key = costmodel.count_key(spec)
        name = _ops_key(key)
        if name in self.counts:
            self.hits += 1
        else:
            t0 = time.perf_counter()
            self.counts[name] = list(costmodel.layer_counts(key))
            self.count_s += time.perf_counter() - t0
            self.counted += 1
            self._save()
        n1, n2 = self.counts[name]
        return costmodel.extrapolate((n1, n2), spec.cfg.layers)

    def _save(self) -> None:
        if not self.path:
            return
        from tspbench.runtime.record import write_atomic

        # and what others wrote meanwhile
        self.counts = {**self._read(), **self.counts}
        try:
            write_atomic(self.path, json.dumps(self.counts))
        except OSError:
            self.path = None  # unwritable cache: keep counting in memory


def estimate_peak(spec: RunSpec, root: Path | None, kernel: str = "fused") -> dict:
    """The fake-tensor estimator's peak for rank 0 (zigzag's largest buffers), cached on disk
    by spec, kernel and code digest."""
    from tspbench.projection.estimate import estimate

    key = json.dumps([spec.to_argv(), kernel, dataclasses.asdict(spec.cfg)], sort_keys=True)
    path = None
    if root:
        path = (
            root
            / f"estimate-{code_digest()}"
            / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
        )
        if path.exists():
            try:
                old = json.loads(path.read_text())
                if isinstance(old.get("peak_mem_bytes"), int | float) and old.get("key") == key:
                    return {**old, "cached": True}
            except (OSError, ValueError, AttributeError):
                pass
    est = estimate(spec, [0], kernel)
    out = {"peak_mem_bytes": est["peak_mem_bytes"], "estimate_s": est["estimate_s"], "key": key}
    if path:
        from tspbench.runtime.record import write_json

        try:
            write_json(path, out)
        except OSError:
            pass
    return {**out, "cached": False}
