"""The requirements an image installs beside its own torch: the package's dependencies and its
pipeline extra from pyproject.toml, torch left out (the base image's build is the point: a
vendor torch such as NGC's 2.x.0a0+... is a pre-release that ``torch>=2.11`` does not contain,
so pip would replace it with a public wheel). Run by env/tspbench.def; tests/unit/
test_container_def.py runs it too. Usage: python env/container_deps.py [pyproject.toml]."""

from __future__ import annotations

import re
import sys
import tomllib


def deps(pyproject: str = "pyproject.toml") -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["pipeline"]
    return [d for d in wanted if re.split(r"[\s<>=!~\[;]", d, maxsplit=1)[0].lower() != "torch"]


if __name__ == "__main__":
    print("\n".join(deps(*sys.argv[1:])))
