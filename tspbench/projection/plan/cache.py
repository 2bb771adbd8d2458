"""What a plan keeps on disk (``~/.cache/tspbench``): operation counts per configuration
(:class:`OpsCache`) and the fake-tensor estimator's peaks (:func:`estimate_peak`), both keyed by a
digest of the step's code. Split from the search because counting is the slow part (seconds
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
        *Path(baselines.__file__).parent.rglob("*.py"),  # (one folder per strategy)
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
                       key.recompute, dict(key.options)], sort_keys=True)  # fmt: skip


MAX_OPS = 10**8  # operations per layer count: far above any model's (about 10^4 per layer)


def _checksum(counts: dict) -> str:
    return hashlib.sha256(json.dumps(counts, sort_keys=True).encode()).hexdigest()


def _valid(v: object) -> bool:
    """One- and two-layer counts: integers with 0 < n1 < n2 (a layer adds operations)."""
    if not isinstance(v, list) or len(v) != 2:
        return False
    if any(isinstance(n, bool) or not isinstance(n, int) for n in v):
        return False
    return 0 < v[0] < v[1] <= MAX_OPS


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
        """The counts on disk: a file whose checksum does not match (edited, cut, foreign) counts
        as empty, and so does an entry out of range (a plan would use it silently)."""
        assert self.path is not None  # read only where there is a cache directory
        try:
            data = json.loads(self.path.read_text()) if self.path.exists() else {}
            counts = data["counts"]
            if not isinstance(counts, dict) or data["sha256"] != _checksum(counts):
                return {}
        except (OSError, ValueError, TypeError, KeyError):
            return {}
        return {k: v for k, v in counts.items() if _valid(v)}

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
            doc = {"counts": self.counts, "sha256": _checksum(self.counts)}
            write_atomic(self.path, json.dumps(doc))
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
                peak = old.get("peak_mem_bytes")
                if isinstance(peak, int) and peak > 0 and old.get("key") == key:
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
