"""On PYTHONPATH, makes this interpreter behave like a bare GPU image: the packages such an
image may lack (the pipeline's, the tests', MPI) cannot be imported (test_gpucheck.py)."""

import sys
from importlib.abc import MetaPathFinder

ABSENT = ("pandas", "matplotlib", "seaborn", "snakemake", "jsonschema", "scipy", "transformers",
          "mpi4py", "pyarrow", "tabulate", "jinja2", "pytest")  # fmt: skip


class _Absent(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on a bare GPU image)")
        return None


sys.meta_path.insert(0, _Absent())
