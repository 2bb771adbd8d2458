"""The CLI says what it is and what its defaults are."""

import re

import pytest

from tspbench.cli import main


def test_version_is_one_line_naming_package_commit_torch_and_python(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out.strip().splitlines()
    assert e.value.code == 0 and len(out) == 1
    assert re.fullmatch(r"tspbench \S+ \(commit [^)]+\), torch \S+, python 3\.\d+\.\d+", out[0])


def test_help_shows_the_defaults_worth_showing(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "model replicas (default: 1)" in text
    assert "(default: 0)" in text  # a zero default is a default (--seed, --kv-bucket)
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.parametrize("cmd", ["model", "estimate", "project"])
def test_commands_that_time_nothing_take_no_timing_options(capsys, cmd):
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    text = capsys.readouterr().out
    assert not {"--warmup", "--steps", "--quiet", "--max-memory"} & set(
        re.findall(r"--[\w-]+", text)
    )
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert {"--warmup", "--steps", "--quiet"} <= set(
        re.findall(r"--[\w-]+", capsys.readouterr().out)
    )


@pytest.mark.parametrize(
    "argv, hint",
    [(["projct"], "did you mean 'project'?"),
     (["run", "--strategy", "fsdp-cp", "--seq-len", "8"], "did you mean 'fsdp_cp'?")],
)  # fmt: skip
def test_a_typo_gets_did_you_mean(capsys, argv, hint):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().endswith(hint) and err.count("\n") == 1, err
