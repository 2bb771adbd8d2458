"""The rules inside a software environment, for real: `--sdm apptainer` runs a cell through
`apptainer exec ... <image>` with the GPU flag, `--sdm conda` builds env/environment.yml from
the copy Snakemake makes of it and runs a cell with that environment's python.

Neither Apptainer nor conda is installed where the suite is built, and no conda channel is
reachable from there: stand-ins on PATH do what Snakemake asks of each (answer the version
and info queries; `apptainer exec` runs the wrapped command on the host after checking the
image exists; `conda env create` reads the copied env file and resolves its pip entries from
the copy's folder, as conda does, then makes an environment whose python is this
interpreter). Each logs what it was called with, and the tests assert on that log."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import yaml

from tests.helpers.configs import MINI
from tests.helpers.runner import ROOT, copy_workflow
from tests.helpers.runner import snakemake as smk

CELL = "tsp.D2.g2.S32.B1.train"
TARGET = f"results/mini/runs/{CELL}.json"

APPTAINER = """#!{python}
# stand-in for apptainer: the version query, and exec of a command "in" an existing image
import os, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(repr(args) + "\\n")
if args == ["--version"]:
    print("apptainer version 1.3.4")
    sys.exit(0)
args = args[args.index("exec") + 1 :]
valued = {{"--home", "--bind", "-B", "--pwd", "--env"}}
while args[0].startswith("-"):
    args = args[2:] if args[0] in valued else args[1:]
image, cmd = args[0], args[1:]
if not os.path.isfile(image):
    sys.exit(f"FATAL: could not open image {{image}}: no such file")
os.execvp(cmd[0], cmd)
"""

CONDA = """#!{python}
# stand-in for conda: version and info queries, and `env create --file F --prefix P`, which
# reads F and resolves its pip entries from F's folder as conda's pip installer does
import json, os, sys, yaml
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(repr(args) + "\\n")
if args == ["--version"]:
    print("conda 24.11.3")
elif args[:2] == ["info", "--json"]:
    print(json.dumps({{"conda_prefix": {root!r}, "platform": "linux-64"}}))
elif args[:1] == ["clean"]:
    pass
elif args[:2] == ["config", "--get"]:
    print(json.dumps({{"get": {{"channel_priority": "strict"}}}}))
elif args[:2] == ["env", "create"]:
    file, prefix = args[args.index("--file") + 1], args[args.index("--prefix") + 1]
    env = yaml.safe_load(open(file))
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    for entry in pip:
        opt, _, value = entry.partition(" ")
        path = value if opt in ("-r", "-e", "-c") else (entry if entry[0] in "./" else None)
        if path and not os.path.exists(os.path.join(os.path.dirname(file), path.split("[")[0])):
            sys.exit(f"ERROR: Could not open requirements file: {{path}} (from {{file}})")
    os.makedirs(os.path.join(prefix, "bin"))
    python = os.path.join(prefix, "bin", "python")
    with open(python, "w") as f:
        f.write(f"#!/bin/sh\\necho \\"$0 $*\\" >> {log!r}\\nexec {sys_python} \\"$@\\"\\n")
    os.chmod(python, 0o755)
else:
    sys.exit(f"fake conda: unexpected {{args}}")
"""


def _script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def _mini(work: Path, **extra: object) -> None:
    work.mkdir()
    copy_workflow(work)
    (work / "cfg.yaml").write_text(yaml.safe_dump({**MINI, **extra}))


def _record(work: Path) -> dict:
    return json.loads((work / TARGET).read_text())


def test_environment_file_lists_requirements_cpu_and_no_path():
    env = yaml.safe_load((ROOT / "env/environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    pins = [p for p in pip if not p.startswith("-")]
    lines = (ROOT / "env/requirements-cpu.txt").read_text().splitlines()
    assert pins == [x for x in lines if x and not x.startswith("#")]
    assert pip[0] == "--extra-index-url https://download.pytorch.org/whl/cpu"
    assert not [p for p in pip if p.split()[0] in ("-r", "-e", "-c") or p[0] in "./"]


def test_under_apptainer_a_cell_runs_in_the_image_with_the_gpu_flag(tmp_path):
    work, fake, log = tmp_path / "wf", tmp_path / "bin", tmp_path / "apptainer.log"
    _script(fake / "apptainer", APPTAINER.format(python=sys.executable, log=str(log)))
    _script(fake / "python", f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    _mini(work, container="img/tspbench.sif", container_gpu="cuda")
    (work / "img").mkdir()
    (work / "img/tspbench.sif").write_bytes(b"")  # the image apptainer is asked to open
    env = {"PATH": f"{fake}:{os.environ['PATH']}"}
    p = smk(
        TARGET, "--sdm", "apptainer", "--cores", "2", "--configfile", "cfg.yaml", cwd=work, env=env
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert _record(work)["status"] == "ok"
    calls = [eval(line) for line in log.read_text().splitlines()]  # noqa: S307 (our own repr)
    (run,) = [c for c in calls if "exec" in c]
    image = run.index("img/tspbench.sif")
    assert "--nv" in run[:image] and run[image + 1 : image + 3][1] == "-c"
    assert "python -m tspbench run --strategy tsp" in run[image + 3]

    # a GPU sweep must name the flag (else the image sees no GPU); rocm gives --rocm
    _mini(work2 := tmp_path / "wf2", gpu=True)
    args = ["-n", "-p", "--sdm", "apptainer", "--cores", "2", "--configfile", "cfg.yaml"]
    p = smk(*args, cwd=work2, env=env)
    assert p.returncode != 0 and "config error: container_gpu: gpu: true" in p.stdout + p.stderr
    assert smk(*args, "--apptainer-args=--rocm", cwd=work2, env=env).returncode == 0
    (work2 / "cfg.yaml").write_text(yaml.safe_dump({**MINI, "gpu": True, "container_gpu": "rocm"}))
    p = smk(*args, cwd=work2, env=env)
    assert p.returncode == 0 and "--device cuda" in p.stdout, (p.stdout + p.stderr)[-3000:]


def test_under_conda_a_cell_runs_with_the_environments_python(tmp_path):
    work, root, log = tmp_path / "wf", tmp_path / "conda", tmp_path / "conda.log"
    python = sys.executable
    text = CONDA.format(python=python, log=str(log), root=str(root), sys_python=python)
    _script(root / "bin/conda", text)
    _script(root / "bin/activate", 'PATH="$1/bin:$PATH"; export PATH\n')
    _mini(work)
    env = {"PATH": f"{root / 'bin'}:{os.environ['PATH']}"}
    p = smk(TARGET, "--sdm", "conda", "--cores", "2", "--configfile", "cfg.yaml", cwd=work, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert _record(work)["status"] == "ok"
    calls = log.read_text().splitlines()
    (create,) = [eval(c) for c in calls if "'create'" in c]  # noqa: S307 (our own repr)
    copy = Path(create[create.index("--file") + 1])
    assert (
        copy.parent == work / ".snakemake/conda"
        and copy.read_text() == (ROOT / "env/environment.yml").read_text()
    )
    ran = [c for c in calls if c.startswith(str(work / ".snakemake/conda"))]
    assert any("-m tspbench run --strategy tsp" in c for c in ran), calls
