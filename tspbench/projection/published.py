"""``tspbench project-check --published``: the cost model against published end-to-end training
throughput it was never fitted to (``published.json``). Each point is projected through the
same code path as ``tspbench project`` (the preset's default MLP schedule included), and the
table says projected / published per point: a judge of the model, never an input to it."""

from __future__ import annotations

import math
import statistics
from importlib import resources
from pathlib import Path
from typing import Any

from tspbench.core.config import ConfigError, get_config, read_json_input
from tspbench.runtime.spec import RunSpec

DEFAULT = "projection/published.json"
POINT_FIELDS: dict[str, type | tuple[type, ...]] = {  # field: the type it must have
    "id": str, "model": str, "set": dict, "seq_len": int, "gpus": int, "strategy": str,
    "degree": int, "tp": int, "sp": int, "dp": int, "batch": int, "precision": str,
    "recompute": str, "preset": str, "published_tokens_per_s_per_gpu": (int, float),
    "source": dict, "quote": str, "setup": str, "layout_note": str,
}  # fmt: skip
SOURCE_FIELDS = ("title", "url", "date")
POSITIVE = ("seq_len", "gpus", "degree", "tp", "sp", "dp", "batch",
            "published_tokens_per_s_per_gpu")  # fmt: skip
PRECISIONS = ("bf16",)  # fp8 is not projected: such points stay out of the file
RECOMPUTE = ("none", "full")


def default_path() -> Path:
    """The committed file (package data, so an installed suite has it too)."""
    return Path(str(resources.files("tspbench").joinpath(DEFAULT)))


def _bad(where: str, field: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"{where}.{field}={value!r}: {rule}")


def _check_point(i: int, p: Any, presets: dict, strategies: dict) -> None:
    """One point's fields, types and values, or a ConfigError naming field, value and rule."""
    where = f"points[{i}]"
    if not isinstance(p, dict):
        raise ConfigError(f"{where}={p!r}: must be an object")
    where = f"points[{i}]({p.get('id', '?')})"
    _check_types(where, p)
    _check_values(where, p, presets, strategies)
    _check_source(where, p)


def _check_types(where: str, p: dict) -> None:
    """Every field present, of its type, a string not blank, a size positive and finite."""
    for field, kind in POINT_FIELDS.items():
        if field not in p:
            raise _bad(where, field, None, "missing; every point needs it")
        v = p[field]
        if not isinstance(v, kind) or isinstance(v, bool):
            raise _bad(where, field, v, f"must be of type {getattr(kind, '__name__', 'number')}")
        if isinstance(v, str) and not v.strip():
            raise _bad(where, field, v, "must not be empty")
    for field in POSITIVE:
        v = p[field]
        if not math.isfinite(v) or v <= 0:
            raise _bad(where, field, v, "must be a positive number")


def _check_values(where: str, p: dict, presets: dict, strategies: dict) -> None:
    """The strategy, preset, precision and recompute known; the GPUs the layout's."""
    if p["strategy"] not in strategies:
        raise _bad(where, "strategy", p["strategy"], f"must be one of {', '.join(strategies)}")
    if p["preset"] not in presets:
        raise _bad(where, "preset", p["preset"], f"must be one of {', '.join(sorted(presets))}")
    if p["precision"] not in PRECISIONS:
        raise _bad(where, "precision", p["precision"], f"must be one of {', '.join(PRECISIONS)}")
    if p["recompute"] not in RECOMPUTE:
        raise _bad(where, "recompute", p["recompute"], f"must be one of {', '.join(RECOMPUTE)}")
    if p["gpus"] != p["degree"] * p["dp"]:
        raise _bad(where, "gpus", p["gpus"], f"must equal degree x dp = {p['degree'] * p['dp']}")


def _check_source(where: str, p: dict) -> None:
    """The source's title, address and date given; the address https."""
    for field in SOURCE_FIELDS:
        v = p["source"].get(field)
        if not isinstance(v, str) or not v.strip():
            raise _bad(where, f"source.{field}", v, "missing; every source needs it")
    url = p["source"]["url"]
    if not url.startswith("https://"):
        raise _bad(where, "source.url", url, "must be an https:// address")


def load(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The points of ``path`` (default: the committed file), every one checked before any is
    projected, so a bad file costs nothing but its one line."""
    from tspbench.projection.costmodel import presets
    from tspbench.runtime.registry import strategies

    where = "--published"
    data = read_json_input(path or default_path(), where)
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise ConfigError(f"{where}={str(path)!r}: must be an object with a 'points' list")
    points = data["points"]
    if not points:
        raise ConfigError(f"{where}={str(path)!r}: 'points' must not be empty")
    known, strats = presets(), strategies()
    ids = set()
    for i, p in enumerate(points):
        _check_point(i, p, known, strats)
        if p["id"] in ids:
            raise _bad(f"points[{i}]", "id", p["id"], "must be unique")
        ids.add(p["id"])
        spec(p)  # the model and layout must build: a ConfigError names what does not
    return points


def spec(p: dict[str, Any]) -> RunSpec:
    """The suite's case of one point (the model's overrides applied)."""
    try:
        cfg = get_config(p["model"], **p["set"])
    except (TypeError, ValueError) as e:  # an unknown field, or a value out of range
        raise ConfigError(f"point {p['id']}: model={p['model']!r} set={p['set']!r}: {e}") from None
    return RunSpec.make(
        p["strategy"], cfg, degree=p["degree"], tp=p["tp"], sp=p["sp"], dp=p["dp"],
        seq_len=p["seq_len"], batch=p["batch"], mode="train", dtype=p["precision"],
        recompute=p["recompute"], quiet=True,
    )  # fmt: skip


def project_point(p: dict[str, Any]) -> dict[str, Any]:
    """``tspbench project``'s projection of one point on its preset: the same code path
    (load_preset, the options the preset chooses, costmodel.project), per GPU."""
    from tspbench.projection.costmodel import load_preset, project

    preset = load_preset(p["preset"])
    c = spec(p).preset_options(preset)
    res = project(c, preset)
    per_gpu = res["tokens_per_s"] / (c.degree * c.dp)
    return {"per_gpu": per_gpu, "ratio": per_gpu / p["published_tokens_per_s_per_gpu"], **res}


def rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point: what was published, what the model says, and their ratio."""
    out = []
    for p in points:
        r = project_point(p)
        out.append({"point": p, "projected": r["per_gpu"], "ratio": r["ratio"], "proj": r})
    return out


def _layout(p: dict[str, Any]) -> str:
    if p["strategy"] == "tpsp":
        lay = f"tpsp {p['tp']}x{p['sp']}"
    else:
        lay = p["strategy"] + (f" D={p['degree']}" if p["degree"] > 1 else "")
    return lay + (f" dp={p['dp']}" if p["dp"] > 1 else "")


def report(table: list[dict[str, Any]]) -> str:
    """The Markdown table and its summary line (median ratio and range)."""
    head = ("| point | model | S | GPUs | layout | rc | preset | source | published tok/s/GPU "
            "| projected | projected/published |")  # fmt: skip
    lines = [head, "|" + " --- |" * 11]
    for r in table:
        p = r["point"]
        src = f"[{p['source']['title'].split(',')[0]}]({p['source']['url']})"
        lines.append(
            f"| {p['id']} | {p['model']}{'*' if p['set'] else ''} | {p['seq_len']} | "
            f"{p['gpus']} | {_layout(p)} | {p['recompute']} | {p['preset']} | {src} | "
            f"{p['published_tokens_per_s_per_gpu']:,.0f} | {r['projected']:,.0f} | "
            f"{r['ratio']:.2f} |"
        )
    ratios = [r["ratio"] for r in table]
    off = sum(abs(x - 1) > 0.25 for x in ratios)
    sources = len({r["point"]["source"]["url"] for r in table})
    star = any(r["point"]["set"] for r in table)
    lines.append("")
    lines.append(
        f"{len(ratios)} points from {sources} source documents: projected/published median "
        f"{statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}; "
        f"off by more than 25%: {off}/{len(ratios)}"
        + ("  (* model fields overridden: see the point's set)" if star else "")
    )
    return "\n".join(lines) + "\n"
