"""Where a rank learns who it is: Slurm node lists in the forms Slurm documents, expanded the
way `scontrol show hostnames` expands them."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tspbench.core.config import ConfigError
from tspbench.runtime.launch import expand_nodelist

FORMS = {
    "node1": ["node1"],
    "node[1-3]": ["node1", "node2", "node3"],
    "gpu[03-05,09],cpu1": ["gpu03", "gpu04", "gpu05", "gpu09", "cpu1"],
    "r[1-2]n[01-02]": ["r1n01", "r1n02", "r2n01", "r2n02"],
    "a1,b[2-3]": ["a1", "b2", "b3"],
    "n[001-002],m[7]": ["n001", "n002", "m7"],
    "rack1-node[8-10]": ["rack1-node8", "rack1-node9", "rack1-node10"],
}


@pytest.mark.parametrize("nodelist, hosts", FORMS.items())
def test_nodelists_expand_as_slurm_documents(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["n[1-", "a]b", "x,,y", "n[a-b]", ""])
def test_a_malformed_nodelist_is_refused(nodelist):
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(nodelist)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="no Slurm client here")
def test_the_parser_agrees_with_scontrol():
    for nodelist, hosts in FORMS.items():
        p = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True)
        assert p.returncode == 0 and p.stdout.decode().split() == hosts, (nodelist, p.stderr)
