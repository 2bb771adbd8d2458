"""env/tspbench.def read as Apptainer reads it (no Apptainer here to build it): the image keeps
its base's torch, copies no local state, pins nothing it cannot check and swallows no failure
(issue 36: the old definition let pip replace NGC's torch pre-release with a public wheel,
copied .venv/, results/ and .snakemake/ in, took rocm/pytorch:latest, ignored a failed
flash-attn build and installed the mpich wheel over the site's MPI)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers.runner import ROOT

DEF = (ROOT / "env/tspbench.def").read_text()


def section(name: str) -> list[str]:
    """The lines of ``%name`` (up to the next section), stripped, comments dropped."""
    m = re.search(rf"^%{name}\n(.*?)(?=^%|\Z)", DEF, re.S | re.M)
    assert m, f"no %{name} section"
    return [x.strip() for x in m[1].splitlines() if x.strip() and not x.strip().startswith("#")]


def test_the_base_is_named_by_the_builder_and_no_tag_floats():
    assert re.search(r"^From: \{\{ BASE \}\}$", DEF, re.M)
    assert not any(x.startswith("BASE=") for x in section("arguments"))  # no default to drift
    assert ":latest" not in DEF


def test_only_the_package_sources_go_in():
    sources = [x.split()[0] for x in section("files")]
    assert set(sources) == {"pyproject.toml", "README.md", "tspbench", "tsp_impl", "baselines",
                            "env/container_deps.py"}  # fmt: skip
    for path in sources:
        assert (ROOT / path).exists(), path


def test_torch_is_never_installed_and_its_version_is_checked():
    post = "\n".join(section("post"))
    assert "set -eu" in post and "|| echo" not in post and "|| true" not in post
    installs = [x for x in section("post") if x.startswith("pip install")]
    suite = [x for x in installs if x.endswith(" .")]
    assert len(suite) == 1 and "--no-deps" in suite[0]
    assert not any(re.search(r"\btorch\b", x) for x in installs)
    assert (
        "mpich" not in post and '"{{ MPI }}" = "1"' in post and '"{{ FLASH_ATTN }}" = "1"' in post
    )
    assert 'if [ "$before" != "$after" ]' in post and "require_torch()" in post


def test_the_dependency_list_is_pyprojects_without_torch():
    out = subprocess.run([sys.executable, "env/container_deps.py", "pyproject.toml"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert out and not any(re.match(r"torch\b", d) for d in out)
    assert {"numpy", "pyyaml", "pandas>=2.2"} <= set(out) and "mpich" not in out
