"""Tables and figures from synthetic run records: a cell listed by several sweeps counts in
each (paper.yaml), inference cells get tables and figures, the default sweep's micro-batch table
has several columns, throughput carries the timed steps' spread, axes say GPUs or CPU ranks as
the records do, and the projected figures keep every strategy visible and mark cells that would
not fit."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pandas as pd
import pytest
import yaml

matplotlib.use("Agg")

# the synthetic-record builder lives in tests/helpers/records.py; importers find it here too
from tests.helpers.records import (  # noqa: E402
    CPU,
    GPU,
    decode_fields,
    fake_record,
    summary,
    write_records,
)
from tests.helpers.runner import ROOT  # noqa: E402

PAPER = yaml.safe_load((ROOT / "workflows/config/paper.yaml").read_text())
DEFAULT = yaml.safe_load((ROOT / "workflows/config/default.yaml").read_text())

__all__ = ["CPU", "GPU", "decode_fields", "fake_record", "summary", "write_records"]


@pytest.fixture(scope="module")
def paper(tmp_path_factory) -> tuple[list, pd.DataFrame]:
    """paper.yaml's cells and the aggregate of their synthetic GPU records, made once for the
    module (about 10 s: the records of the 1024-GPU scaling cells are long)."""
    return summary(PAPER, tmp_path_factory.mktemp("paper"))


@pytest.fixture(scope="module")
def default_cpu(tmp_path_factory) -> tuple[list, pd.DataFrame]:
    """default.yaml's cells and the aggregate of their synthetic CPU records (made once)."""
    return summary(DEFAULT, tmp_path_factory.mktemp("default"), launcher="local", hardware=CPU)


def expected_tables(cell, sweep: str) -> list[tuple[str, str]]:
    """(table, column) that must show ``cell`` as a member of ``sweep``."""
    s = cell.spec
    if sweep in ("seq", "comm") and s.mode == "train":  # tables follow what a sweep varies
        return [("memory_vs_seq", str(s.seq_len)), ("throughput_vs_seq", str(s.seq_len))]
    if sweep in ("seq", "comm"):
        return [
            (name, str(s.seq_len))
            for name in ("memory_vs_seq_infer", "throughput_vs_seq_infer", "comm_vs_seq")
        ]
    if sweep == "degree":
        return [(f"memory_vs_degree_S{s.seq_len}", str(s.layout.degree))]
    if sweep in ("microbatch", "batch"):
        return [(f"{sweep}_memory", str(s.batch)), (f"{sweep}_throughput", str(s.batch))]
    if sweep == "scaling":
        return [(f"scaling_{s.mode}_S{s.seq_len}", str(cell.gpus))]
    if sweep == "decode":
        names = ("kv_cache_vs_seq", "decode_memory_vs_seq", "decode_latency_vs_seq")
        return [(name, str(s.seq_len)) for name in names]
    if sweep == "decode_batch":
        return [("decode_throughput_vs_batch", str(s.batch))]
    if sweep == "pipeline":
        tag = f"S{s.seq_len}_D{s.layout.degree}"
        stages = str(s.layout.pp)
        return [(f"pipeline_memory_{tag}", stages), (f"pipeline_throughput_{tag}", stages)]
    if sweep == "moe":
        tag = f"E{s.cfg.experts}_D{s.layout.degree}"
        return [(f"moe_{k}_{tag}", str(s.seq_len)) for k in ("memory", "throughput", "comm")]
    raise AssertionError(f"no table known for sweep {sweep}")


def test_every_sweep_of_paper_yaml_shows_every_one_of_its_cells(paper, tmp_path):
    """A cell listed by two sweeps runs once and has one row, and appears in both sweeps'
    tables and figures: the D = 8 column of memory_vs_degree, the 8-GPU scaling point."""
    from tspbench.pipeline.figures import write_figures
    from tspbench.pipeline.tables import write_tables

    cells, df = paper
    assert len(df) == len(cells) and df["cell"].is_unique  # one run, one record, one row
    shared = {c.id: c.sweeps for c in cells if len(c.sweeps) > 1}
    assert shared["tsp.D8.g8.S16384.B1.train"] == ("seq", "degree")
    assert shared["tsp.D8.g8.S131072.B1.infer"] == ("seq", "scaling")
    tables = _every_cell_shown(cells, df, tmp_path)
    for S in (16384, 131072):
        assert list(tables[f"memory_vs_degree_S{S}"].columns) == ["2", "4", "8"]
        assert list(tables[f"scaling_infer_S{S}"].columns)[0] == "8"
    df = pd.read_csv(_csv(df, tmp_path))
    md = write_tables(df, tmp_path / "t")
    assert {p.stem for p in md} == set(tables)
    assert all((tmp_path / "t/html" / f"{p.stem}.html").exists() for p in md)
    pngs = {p.stem for p in write_figures(df, tmp_path / "f") if p.suffix == ".png"}
    assert {
        "memory_vs_degree_S16384",
        "throughput_vs_gpus_infer_S16384",
        "memory_vs_seq_infer",
        "throughput_vs_seq_infer",
        "microbatch_throughput",
        "kv_cache_vs_seq",
        "decode_latency_vs_seq",
        "decode_throughput_vs_batch",
    } <= pngs


def test_every_variant_of_default_yaml_is_its_own_labelled_row(default_cpu, tmp_path):
    """The default sweep's exchanges of SP and FSDP+CP (all_gather, ring, a2a) each have a row
    of their own (their label) in its tables and are drawn in its figures."""
    cells, df = default_cpu
    tables = _every_cell_shown(cells, df, tmp_path)
    rows = set(tables["memory_vs_seq"].index)
    assert {"sp", "sp (ring)", "sp (a2a)", "fsdp_cp", "fsdp_cp (ring)", "fsdp_cp (a2a)"} <= rows


def _every_cell_shown(cells: list, df: pd.DataFrame, tmp_path: Path) -> dict:
    """Assert every cell has its value in each of its sweeps' tables (row: its label) and is
    drawn in a figure of each; return the tables by name."""
    from tspbench.pipeline.decode_figures import decode_plots
    from tspbench.pipeline.figures import plots
    from tspbench.pipeline.tables import specs

    df = pd.read_csv(_csv(df, tmp_path))  # what tables and figures read: the CSV
    tables = {name: table for name, _, table in specs(df)}
    for c in cells:
        for sweep in c.sweeps:
            for name, column in expected_tables(c, sweep):
                shown = tables[name].loc[c.spec.label, column]
                assert float(shown) > 0, (c.id, sweep, name, shown)
    drawn: dict[str, set] = {}
    for p in [*plots(df), *decode_plots(df)]:
        for sweep in p.sweep.split("+"):
            drawn.setdefault(sweep, set()).update(p.data["cell"])
    for sweep in {s for c in cells for s in c.sweeps}:
        missing = {c.id for c in cells if sweep in c.sweeps} - drawn[sweep]
        assert not missing, f"{sweep}: not in any figure: {sorted(missing)[:5]}"
    return tables


def _csv(df: pd.DataFrame, tmp_path: Path) -> Path:
    path = tmp_path / "summary.csv"
    df.to_csv(path, index=False)
    return path


def test_inference_cells_have_memory_and_throughput_tables(paper):
    """paper.yaml's seq sweep has 40 forward-only cells (16 of them SP's and FSDP+CP's other
    exchanges): every one is in the inference memory and throughput tables (and figures), not
    only in the bytes table, each exchange as its own row."""
    from tspbench.pipeline.figures import plots
    from tspbench.pipeline.tables import specs

    cells, df = paper
    infer = [c for c in cells if "seq" in c.sweeps and c.spec.mode == "infer"]
    assert len(infer) == 40
    tables = {name: (caption, t) for name, caption, t in specs(df)}
    for name in ("memory_vs_seq_infer", "throughput_vs_seq_infer"):
        caption, table = tables[name]
        assert table.shape == (10, 4) and "-" not in table.values, table
        assert "forward" in caption or "Inference" in caption
    assert list(tables["memory_vs_seq_infer"][1].index)[0] == "tsp"
    figs = {p.name: p for p in plots(df)}
    assert set(figs["throughput_vs_seq_infer"].data["cell"]) == {c.id for c in infer}


def test_default_micro_batch_sweep_has_three_columns_and_about_the_same_cells(default_cpu):
    """The default sweep's micro-batch tables have at least three micro-batches; the sweep
    stays about as long as before (75 cells, about 7 min on 2 cores, and 12 decode cells; 12 of
    them SP's and FSDP+CP's ring, a2a and a2a+p2p exchanges, 2 TSP's K/V ring, 2 PyTorch's
    FSDP2, 4 its DTensor TP, 4 the pipeline sweep's, 10 the experts' at two lengths, each
    about 6 s): the B = 1 cells are the seq sweep's, run once."""
    from tspbench.pipeline.tables import specs

    batch = next(s for s in DEFAULT["sweeps"] if s["name"] == "batch")
    assert len(batch["batches"]) >= 3
    cells, df = default_cpu
    assert len([c for c in cells if not c.spec.decoding]) <= 75
    assert len([c for c in cells if c.spec.decoding]) <= 12  # ~1.5 min on 2 cores
    tables = {name: t for name, _, t in specs(df)}
    for name in ("batch_memory", "batch_throughput"):
        assert len(tables[name].columns) >= 3 and "tsp" == tables[name].index[0]
        assert (tables[name].loc["tsp"] != "-").all()


@pytest.mark.parametrize("which", ["paper", "default_cpu"])
def test_tables_and_figures_follow_what_a_sweep_varies_not_its_name(which, request):
    """Every sweep renamed (issue 35: a sweep named 'four' had no tables): the same tables
    with the same contents, the micro-batch ones named after their sweep, and the same
    cells in the figures."""
    from tspbench.pipeline.figures import plots
    from tspbench.pipeline.tables import specs

    _, df = request.getfixturevalue(which)
    new = {
        n: f"x{i}"
        for i, n in enumerate(
            sorted({s["name"] for s in PAPER["sweeps"]} | {s["name"] for s in DEFAULT["sweeps"]})
        )
    }
    renamed = df.assign(
        sweep=df["sweep"].str.split(";").map(lambda ns: ";".join(new[n] for n in ns))
    )  # fmt: skip

    def key(name: str) -> str:
        for old in ("batch", "microbatch"):  # the micro-batch sweeps: tables by sweep name
            if name.startswith((f"{old}_memory", f"{old}_throughput")):
                return f"{new[old]}{name[len(old) :]}"
        return name

    before = {key(n): t for n, _, t in specs(df)}
    after = {n: t for n, _, t in specs(renamed)}
    assert set(after) == set(before) and len(after) > 5
    for n, t in after.items():
        pd.testing.assert_frame_equal(t, before[n])
    drawn = {key(p.name): set(p.data["cell"]) for p in plots(df)}
    assert {p.name: set(p.data["cell"]) for p in plots(renamed)} == drawn


def test_throughput_has_step_spread_and_axes_name_the_device(default_cpu, paper):
    """Throughput figures draw the timed steps' min-max as error bars (tokens per step over
    the slowest and fastest step); the GPU axis says CPU ranks for a CPU run, GPUs for GPUs."""
    from tspbench.pipeline.figures import line, plots
    from tspbench.pipeline.plotting import palette, styles
    from tspbench.pipeline.tables import device, hardware

    _, cpu = default_cpu
    assert device(cpu) == ("CPU rank", "CPU ranks")
    assert hardware(cpu) == "AMD EPYC 7763 64-Core Processor, 2 CPUs (CPU ranks)"
    named_only = cpu.drop(columns=["device_type"])  # an older summary: the name decides
    assert device(named_only) == ("CPU rank", "CPU ranks")
    assert device(named_only.assign(device_name="NVIDIA H100 80GB HBM3")) == ("GPU", "GPUs")
    figs = {p.name: p for p in plots(cpu)}
    scaling = figs["throughput_vs_gpus_train_S1024"]
    assert scaling.xlabel == "CPU ranks" and scaling.spread == ("tokens_lo", "tokens_hi")
    d = scaling.data
    per_step = d["tokens_per_s"] * d["step_time_s"]
    assert (d["tokens_lo"] == per_step / d["step_time_max_s"]).all()
    assert (d["tokens_hi"] == per_step / d["step_time_min_s"]).all()
    assert (d["tokens_lo"] < d["tokens_per_s"]).all() and (d["tokens_hi"] > d["tokens_per_s"]).all()
    assert "per CPU rank" in figs["memory_vs_seq"].ylabel
    colors, marks = palette(cpu["label"]), styles(cpu["label"])
    for name in ("throughput_vs_seq", "throughput_vs_seq_infer", "batch_throughput"):
        fig = line(figs[name], colors, marks)
        ax = fig.axes[0]
        bars = [c for c in ax.containers if isinstance(c, matplotlib.container.ErrorbarContainer)]
        assert len(bars) == len(set(figs[name].data["label"])), name

    _, gpu = paper
    figs = {p.name: p for p in plots(gpu)}
    assert figs["throughput_vs_gpus_infer_S16384"].xlabel == "GPUs"
    assert "per GPU" in figs["memory_vs_seq"].ylabel


def test_tables_follow_the_strategy_registry_order(paper):
    from tspbench.pipeline.tables import label_order, specs
    from tspbench.runtime.registry import strategies

    _, df = paper
    order = list(strategies())
    for name, _, table in specs(df):
        rows = list(table.index)
        assert rows == label_order(rows), name
        ranks = [order.index(r.split(" ")[0]) for r in rows]
        assert ranks == sorted(ranks) and rows[0] == "tsp", (name, rows)


def _fake_project(spec, preset, ops=None) -> dict:
    """A stand-in for the cost model (seconds of fake-tensor op counting per layout): TSP and
    FSDP+CP coincide exactly, the case where TSP must stay visible on top."""
    slower = 1.0 if spec.strategy in ("tsp", "fsdp_cp") else 1.2
    step = 1e-6 * spec.seq_len * spec.batch * slower
    tokens = spec.batch * spec.layout.dp * spec.seq_len
    return {"tokens_per_s": tokens / step, "step_time_s": step, "mfu": 0.4 / slower}


def _fake_range(spec, preset, ops=None) -> tuple[float, float]:
    """The stand-in's range over the rates: 10% faster to 20% slower than its step."""
    step = _fake_project(spec, preset)["step_time_s"]
    return 0.9 * step, 1.2 * step


@pytest.fixture(scope="module")
def projected(tmp_path_factory):
    """The projected report of the committed memory estimates on the H100 preset (80 GB:
    several cells would not fit), throughput from a stand-in cost model; its figures are kept
    for inspection."""
    import tspbench.pipeline.projected as projected
    from tspbench.pipeline.projected import load, write_report

    cfg = load(str(ROOT / "workflows/config/projected.yaml"))
    cfg["hardware"] = ["h100"]
    figures: dict[str, object] = {}
    save = projected.save

    def keep(fig, path):
        figures[Path(path).name] = fig
        return save(fig, path)

    tmp = tmp_path_factory.mktemp("projected")
    mp = pytest.MonkeyPatch()
    mp.setattr(projected, "save", keep)
    mp.setattr(projected, "project", _fake_project)
    mp.setattr(projected, "project_range", _fake_range)
    mp.setattr(projected, "ratio_ranges", lambda cases, preset: [(1.0, 1.0)] * len(cases))
    try:
        write_report(cfg, ROOT / "results/reference/projected-7b/estimates", tmp, tmp, "test")
    finally:
        mp.undo()
    return cfg, tmp, figures


def _red_crosses(axes) -> int:
    """Points drawn as red crosses (the would-not-fit marks) on ``axes``."""
    return sum(
        len(c.get_offsets())
        for ax in axes
        for c in ax.collections
        if len(c.get_offsets()) and tuple(c.get_edgecolor()[0][:3]) == (1.0, 0.0, 0.0)
    )


def _strategy_lines(ax) -> dict[str, object]:
    return {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}


def test_projected_figures_keep_every_strategy_visible(projected):
    """Distinct marker and dash per strategy, TSP drawn last and on top, the legend outside
    the axes, labelled log ticks, and a red cross on every cell that would not fit."""
    cfg, out, figures = projected
    assert set(figures) == {
        "memory_projected",
        "throughput_projected",
        "scaling_projected",
        "microbatch_projected",
    }
    for name, fig in figures.items():
        fig.canvas.draw()
        for ax in fig.axes:
            lines = _strategy_lines(ax)
            if not lines:
                continue
            styles = {(ln.get_marker(), str(ln.get_linestyle())) for ln in lines.values()}
            markers = {ln.get_marker() for ln in lines.values()}
            assert len(markers) == len(lines) and len(styles) == len(lines), name
            assert lines["TSP"].get_zorder() == max(ln.get_zorder() for ln in lines.values())
            assert ax.get_lines().index(lines["TSP"]) > max(
                ax.get_lines().index(ln) for k, ln in lines.items() if k != "TSP"
            ), f"{name}: TSP is not drawn last"
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        assert len(legends) == 1, name
        leg = legends[0]
        host = next(ax for ax in fig.axes if ax.get_legend() is leg)
        box, axes_box = leg.get_window_extent(), host.get_window_extent()
        assert box.x0 >= axes_box.x1, f"{name}: the legend overlaps the axes"

    mem_fig = figures["memory_projected"]
    for ax in mem_fig.axes:
        ticks = [
            t for t in ax.yaxis.get_majorticklocs() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]
        ]
        labels = [ax.yaxis.get_major_formatter()(t) for t in ticks]
        assert len(ticks) >= 5 and all(labels), (ticks, labels)
        assert len(ax.yaxis.get_minorticklocs()) > len(ticks)
    mem = pd.read_csv(out / "memory.csv")
    assert _red_crosses(mem_fig.axes) == (~mem["fits"]).sum() > 0
    scaling = figures["scaling_projected"]
    ax = scaling.axes[0]
    lo, hi = ax.get_ylim()
    ticks = [t for t in ax.yaxis.get_majorticklocs() if lo <= t <= hi]
    assert len(ticks) >= 3 and all(ax.yaxis.get_major_formatter()(t) for t in ticks), ticks
    thr = pd.read_csv(out / "throughput_vs_seq.csv")
    train = thr[thr["mode"] == "train"]
    assert _red_crosses(figures["throughput_projected"].axes) == (~train["fits"]).sum() > 0


def test_the_workflow_declares_every_projected_table(projected):
    """Issue 36: the projected_report rule declares each table it writes (report_files) and the
    figures' folder; nothing else is written beside them."""
    from tspbench.pipeline.projected import report_files

    cfg, tmp, _ = projected
    written = {p.name for p in tmp.iterdir() if p.is_file()}
    assert written == set(report_files(cfg))
    assert {p.name for p in tmp.iterdir() if p.is_dir()} == {"png", "pdf"}


def test_projected_tables_follow_the_strategy_order(projected):
    _, out, _ = projected
    text = (out / "memory.md").read_text()
    rows = [line.split("|")[2].strip() for line in text.splitlines() if line.startswith("| ")]
    rows = rows[1:]  # the header
    assert rows[0] == "tsp" and rows[rows.index("dp") + 1] == "tsp", rows


def _styles_drawn(figs, seen: dict[str, set]) -> dict[str, set]:
    """Every legend label of every line in ``figs``: the (colour, marker, dash) it was drawn in."""
    from matplotlib.colors import to_hex

    for fig in figs:
        for ax in fig.axes:
            for label, ln in _strategy_lines(ax).items():
                style = (to_hex(ln.get_color()), ln.get_marker(), str(ln.get_linestyle()))
                seen.setdefault(label, set()).add(style)
    return seen


def test_a_strategy_looks_the_same_in_every_figure(paper, default_cpu, projected, tmp_path):
    """Issue 36: colours went by position among a figure's labels (SP red in one figure, purple
    in another, single in FSDP+CP's style). Every figure of the paper and default pipelines
    (synthetic records) and of the projected report: one style per label across all of them,
    display names in the legends (TSP, TP+SP (2x4), FSDP+CP), no two labels alike."""
    import matplotlib.pyplot as plt

    import tspbench.pipeline.decode_figures as decode_figures
    import tspbench.pipeline.figures as figures

    seen = _styles_drawn(projected[2].values(), {})

    def keep(fig, path):
        _styles_drawn([fig], seen)
        plt.close(fig)
        return []

    mp = pytest.MonkeyPatch()
    for module in (figures, decode_figures):
        mp.setattr(module, "save", keep)
    try:
        for i, (_, df) in enumerate((paper, default_cpu)):
            figures.write_figures(df, tmp_path / str(i))
    finally:
        mp.undo()
    assert {"TSP", "TP", "SP", "FSDP+CP", "TP+SP (2x4)", "TP+SP (4x2)", "DP"} <= set(seen)
    assert not any(k in seen for k in ("tsp", "fsdp_cp", "tpsp (2x4)")), sorted(seen)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}
    styles = [next(iter(v)) for v in seen.values()]
    assert len(set(styles)) == len(styles)


def test_the_memory_breakdown_draws_the_measured_parts(default_cpu, tmp_path):
    """Issue 36: the breakdown was derived (weights and gradients as numel x element size, the
    rest as "activations + buffers"). Its bars now stack the record's measured split of the
    peak, part by part, from 0; a record without a split is named, not drawn."""
    import matplotlib.pyplot as plt

    import tspbench.pipeline.figures as figures
    from tspbench.runtime.measure import PARTS, part_column

    _, df = default_cpu
    plot = next(p for p in figures.plots(df) if p.kind == "breakdown")
    rows = plot.data[plot.data["status"] == "ok"]
    unsplit = rows["label"].iloc[-1]
    data = plot.data.copy()
    data.loc[data["label"] == unsplit, part_column("weights")] = None
    _, scale = figures.mem_unit(df)
    fig = figures.breakdown(
        figures.Plot(**{**plot.__dict__, "data": data}), scale, "", "", figures.palette(df["label"])
    )
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(PARTS)
    names = [t.get_text() for t in ax.get_xticklabels()]
    assert figures.display(unsplit) not in names and f"not split: {figures.display(unsplit)}" in (
        ax.get_title()
    )
    assert ax.get_ylim()[0] == 0
    for part, bars in zip(PARTS, ax.containers, strict=True):
        for name, bar in zip(names, bars, strict=True):
            row = rows[rows["label"].map(figures.display) == name].iloc[0]
            assert bar.get_height() == pytest.approx(row[part_column(part)] / scale), (part, name)
    tops = {n: sum(b[i].get_height() for b in ax.containers) for i, n in enumerate(names)}
    for name, top in tops.items():  # the parts add up to the recorded peak
        row = rows[rows["label"].map(figures.display) == name].iloc[0]
        assert top == pytest.approx(row["peak_mem_bytes"] / scale)
    plt.close(fig)


def _figures(df: pd.DataFrame, tmp_path: Path) -> dict:
    """Every figure ``write_figures`` draws from ``df``, by name, kept open (nothing written)."""
    import tspbench.pipeline.decode_figures as decode_figures
    import tspbench.pipeline.figures as figures

    drawn = {}
    mp = pytest.MonkeyPatch()
    for module in (figures, decode_figures):
        mp.setattr(module, "save", lambda fig, path: drawn.setdefault(path.name, fig) and [])
    try:
        figures.write_figures(df, tmp_path)
    finally:
        mp.undo()
    return drawn


def test_figures_start_their_axes_at_0_and_draw_bars_at_one_x(default_cpu, paper, tmp_path):
    """Issue 36: no memory or bytes axis started at 0, and with one x value the error bars'
    dodge set strategies at places that read as different lengths. Read back: every linear
    y axis starts at 0 (log axes are the scaling figures'), and a figure of one x value has
    one bar per strategy with a result, from 0, in the registry's order, its x in the title."""
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer

    from tspbench.pipeline.figures import display, plots

    ci = yaml.safe_load((ROOT / "workflows/config/ci.yaml").read_text())
    _, ci_df = summary(ci, tmp_path / "ci", launcher="local", hardware=CPU)  # one length
    seen_bars = 0
    for i, (_, df) in enumerate((default_cpu, paper, (None, ci_df))):
        drawn = _figures(df, tmp_path / str(i))
        single = {
            p.name: p for p in plots(df) if p.kind != "breakdown" and p.data[p.x].nunique() == 1
        }
        for name, fig in drawn.items():
            for ax in fig.axes:
                if ax.get_yscale() == "linear" and ax.has_data():
                    assert ax.get_ylim()[0] == 0, name
            if name in single:
                p, ax = single[name], fig.axes[0]
                bars = [c for c in ax.containers if isinstance(c, BarContainer)]
                ok = p.data[p.data["status"] == "ok"]
                assert len(bars) == 1 and len(bars[0]) == ok["label"].nunique(), name
                names = [t.get_text() for t in ax.get_xticklabels()]
                assert names == [display(k) for k in figures_order(ok["label"])], name
                assert f"= {p.data[p.x].iloc[0]:g}" in ax.get_title(), name
                seen_bars += 1
            plt.close(fig)
    assert seen_bars >= 3  # ci.yaml's forward-only figures: one length


def figures_order(labels) -> list[str]:
    from tspbench.pipeline.tables import label_order

    return label_order(set(labels))


def test_the_crossover_is_marked_only_inside_the_swept_lengths(default_cpu, tmp_path):
    """Issue 36: the analytic crossover sat on the border with no tick, and read as where the
    measured lines cross. Marked only inside the swept lengths, and named as the layers'
    alone; outside, the title says where it is."""
    import matplotlib.pyplot as plt

    import tspbench.pipeline.figures as figures

    _, df = default_cpu
    plot = next(p for p in figures.plots(df) if p.kind == "comm")
    lo, hi = plot.data["seq_len"].min(), plot.data["seq_len"].max()
    colors, marks = figures.palette(df["label"]), figures.styles(df["label"])
    for hidden in (64, 4096):  # the crossover inside, then far above the swept lengths
        data = plot.data.assign(hidden=hidden, kv_dim=hidden, ffn=4 * hidden, q_dim=hidden)
        p = figures.Plot(**{**plot.__dict__, "data": data})
        s_star = 8 * hidden / int(data["batch"].iloc[0])
        fig = figures.comm_figure(p, colors, marks, "", "")
        ax = fig.axes[0]
        vlines = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [s_star, s_star]]
        inside = lo <= s_star <= hi
        assert len(vlines) == (1 if inside else 0), (hidden, s_star, lo, hi)
        texts = " ".join(t.get_text() for t in ax.texts) + ax.get_title()
        assert "layers alone" in texts
        assert inside or "outside" in ax.get_title()
        plt.close(fig)


def test_projected_throughput_axes_share_one_range_from_0(projected, tmp_path):
    """Issue 36: the projected throughput panels had different y ranges. Every preset's panel
    shares one range from 0; the scaling ratio and the micro-batch sweep start at 0 too (the
    log axes excepted)."""
    import tspbench.pipeline.projected as projected_module
    from tspbench.pipeline.projected import load, write_report

    figs = {}
    cfg = load(str(ROOT / "workflows/config/projected.yaml"))
    cfg["hardware"] = ["h100", "mi300x"]  # two panels
    mp = pytest.MonkeyPatch()
    mp.setattr(projected_module, "save", lambda fig, path: figs.setdefault(Path(path).name, fig))

    def faster_on_h100(spec, preset, ops=None):  # the panels' own ranges would differ 3x
        out = _fake_project(spec, preset)
        k = 3.0 if preset["name"] == "h100" else 1.0
        return {
            **out,
            "tokens_per_s": k * out["tokens_per_s"],
            "step_time_s": out["step_time_s"] / k,
        }

    mp.setattr(projected_module, "project", faster_on_h100)
    mp.setattr(projected_module, "project_range", _fake_range)
    mp.setattr(projected_module, "ratio_ranges", lambda cases, preset: [(1.0, 1.0)] * len(cases))
    try:
        write_report(
            cfg, ROOT / "results/reference/projected-7b/estimates", tmp_path, tmp_path, "t"
        )
    finally:
        mp.undo()
    panels = figs["throughput_projected"].axes
    assert len(panels) == 2 and len({ax.get_ylim() for ax in panels}) == 1
    assert panels[0].get_ylim()[0] == 0
    for name in ("scaling_projected", "microbatch_projected"):
        for ax in figs[name].axes:
            if ax.get_yscale() == "linear":
                assert ax.get_ylim()[0] == 0, name
