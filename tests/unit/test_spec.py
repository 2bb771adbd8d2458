"""One run description: a RunSpec survives the command line both ways, names itself the same
everywhere, and refuses what its strategy refuses before anything starts."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers.checks import argv_spec
from tspbench.core.config import ConfigError, get_config
from tspbench.runtime.spec import RunSpec

ARGVS = [
    ["--strategy", "tsp", "--seq-len", "64", "--degree", "4"],
    ["--strategy", "tpsp", "--tp", "2", "--sp", "2", "--seq-len", "128", "--mode", "infer"],
    ["--strategy", "dp", "--degree", "2", "--batch", "4", "--dp", "3", "--seq-len", "32"],
    ["--strategy", "tsp", "--model", "small", "--set", "kv_heads=4", "--seq-len", "64"],
    ["--strategy", "fsdp_cp", "--seq-len", "64", "--degree", "2", "--max-memory", "3M"],
    ["--strategy", "tsp", "--seq-len", "64", "--overlap", "off", "--kv-bucket", "1", "--quiet"],
    ["--strategy", "sp", "--seq-len", "64", "--recompute", "full", "--dtype", "bf16"],
    ["--strategy", "tsp", "--seq-len", "64", "--degree", "2", "--mlp-schedule", "broadcast"],
    ["--strategy", "tsp", "--seq-len", "64", "--degree", "2", "--kv-backward", "save"],
]


@pytest.mark.parametrize("argv", ARGVS, ids=lambda a: " ".join(a[1:4]))
def test_to_argv_rebuilds_the_same_spec(argv):
    spec = argv_spec(argv)
    assert argv_spec(spec.to_argv()) == spec


def test_names_are_asked_of_the_strategy():
    tpsp = argv_spec(["--strategy", "tpsp", "--tp", "2", "--sp", "1", "--seq-len", "64"])
    assert tpsp.id == "tpsp-2x1.D2.g2.S64.B1.train" and tpsp.label == "tpsp (2x1)"
    assert tpsp.header("local", 2)["tp"] == 2 and tpsp.cp == 1
    tsp = argv_spec(["--strategy", "tsp", "--degree", "4", "--dp", "2", "--seq-len", "64"])
    assert tsp.id == "tsp.D4.g8.S64.B1.train" and tsp.label == "tsp"
    assert tsp.header("local", 8)["tp"] is None and tsp.tokens == 64 // 4
    dp = argv_spec(["--strategy", "dp", "--degree", "2", "--batch", "4", "--seq-len", "64"])
    assert dp.tokens == 4 * 64 // 2  # whole sequences per rank


def test_the_mlp_schedule_names_itself_and_is_tsp_only():
    """A broadcast TSP run is its own cell (id, label, record); a ring one keeps the old names;
    a strategy without an MLP schedule refuses any but the default, whoever builds its spec."""
    argv = ["--strategy", "tsp", "--degree", "4", "--seq-len", "64"]
    ring, bcast = argv_spec(argv), argv_spec([*argv, "--mlp-schedule", "broadcast"])
    assert ring.id == "tsp.D4.g4.S64.B1.train" and ring.label == "tsp"
    assert bcast.id == "tsp-mlp-broadcast.D4.g4.S64.B1.train"
    assert bcast.label == "tsp (broadcast MLP)" and bcast.header("local", 4)["mlp_schedule"]
    assert "--mlp-schedule" not in argv_spec(["--strategy", "tp", "--seq-len", "64"]).to_argv()
    assert_tsp_only("mlp_schedule", "broadcast", "tree", "ring, broadcast")


def assert_tsp_only(field: str, value: str, bad: str, choices: str) -> None:
    """Every other strategy refuses ``value`` for a TSP-only ``field``; nobody takes ``bad``."""
    for strategy in ("tp", "sp", "fsdp_cp", "dp", "single"):
        with pytest.raises(ConfigError, match=f"{field}: strategy {strategy} takes no such option"):
            RunSpec.make(strategy, get_config("tiny"), seq_len=64, **{field: value})
    with pytest.raises(ConfigError, match=f"{field}='{bad}': must be one of {choices}"):
        RunSpec.make("tsp", get_config("tiny"), seq_len=64, **{field: bad})


def test_options_belong_to_their_strategy():
    """A spec carries its strategy's declared options, defaults filled in (TP: none); the record
    keeps every strategy's option keys, an unused one at its default, as before."""
    tp, tsp = (argv_spec(["--strategy", s, "--seq-len", "64"]) for s in ("tp", "tsp"))
    assert dict(tp.options) == {} and list(tsp.options) == [
        "overlap", "kv_bucket", "mlp_schedule", "kv_backward", "kv_exchange",
        "moe_schedule"]  # fmt: skip
    keys = list(tp.header("local", 1))
    want = ["recompute", "overlap", "kv_bucket", "mlp_schedule", "kv_backward", "kv_exchange"]
    want += ["moe_schedule"]
    want += ["cp_comm", "cp_a2a", "pp_keep_gathered"]
    want += ["sequence_parallel"]  # (tp_torch's)
    assert keys[keys.index("recompute") :][: len(want) + 1] == [*want, "model_config"]
    assert {k: tp.header("local", 1)[k] for k in tsp.options} == dict(tsp.options)
    assert "--overlap" not in tp.to_argv() and "--kv-bucket" not in tp.to_argv()
    assert tsp.replace(kv_bucket=2).options["kv_bucket"] == 2
    assert dict(tsp.replace(strategy="single", layout=tsp.layout).options) == {}


def test_an_option_is_one_option_and_names_its_cells(monkeypatch):
    """Two strategies that declare one name declare one option; every option has an id tag (two
    cells differing only in it would share an id and one record)."""
    from tspbench.core.options import OVERLAP
    from tspbench.runtime.registry import all_options, get_strategy

    assert all_options()["overlap"] is OVERLAP
    tsp = argv_spec(["--strategy", "tsp", "--seq-len", "64", "--kv-bucket", "1"])
    assert tsp.id.startswith("tsp-kvb1.") and tsp.label == "tsp (KV bucket 1)"
    tp = get_strategy("tp")
    for bad in (dataclasses.replace(OVERLAP, default=False), dataclasses.replace(OVERLAP, tag="")):
        monkeypatch.setattr(tp, "options", (bad,))
        with pytest.raises(ConfigError, match="option overlap of strategy tp"):
            all_options()


def test_frozen_and_keyword_only():
    spec = argv_spec(ARGVS[0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seq_len = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        RunSpec("tsp", get_config("tiny"))  # type: ignore[misc]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--strategy", "tp", "--tp", "2", "--seq-len", "64"], "--tp/--sp: only strategy tpsp"),
        (["--strategy", "tsp", "--degree", "4", "--seq-len", "36"], "must be divisible by 2*D"),
        (["--strategy", "single", "--degree", "2", "--seq-len", "64"], "degree=2"),
    ],
)
def test_a_bad_spec_is_refused_on_construction(argv, needle):
    with pytest.raises(ConfigError, match=needle.replace("*", r"\*").replace("/", "/")):
        argv_spec(argv)


@pytest.mark.parametrize("field", ["dtype", "mode", "recompute", "mlp_schedule"])
def test_a_spec_refuses_unknown_choices_whoever_builds_it(field):
    """Not only argparse: a config or a library caller cannot build a spec with a value that
    reaches a command line unchecked (e.g. a dtype of "fp32$(touch F)")."""
    with pytest.raises(ConfigError, match=f"{field}='fp32\\$\\(touch F\\)': must be one of"):
        RunSpec.make("tsp", get_config("tiny"), seq_len=64, **{field: "fp32$(touch F)"})


def test_the_kv_backward_names_itself_and_is_tsp_only():
    """A TSP run that keeps its K/V for backward is its own cell; other strategies refuse it."""
    argv = ["--strategy", "tsp", "--degree", "4", "--seq-len", "64"]
    save = argv_spec([*argv, "--kv-backward", "save"])
    assert save.id == "tsp-kvsave.D4.g4.S64.B1.train" and save.label == "tsp (K/V saved)"
    assert save.header("local", 4)["kv_backward"] == "save"
    assert argv_spec(argv).header("local", 4)["kv_backward"] == "regather"
    assert "--kv-backward" not in argv_spec(["--strategy", "tp", "--seq-len", "64"]).to_argv()
    assert_tsp_only("kv_backward", "save", "keep", "regather, save")
