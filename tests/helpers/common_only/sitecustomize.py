"""On PYTHONPATH, makes this interpreter behave like a bare GPU image: the packages such an
image may lack (the pipeline's, the tests', MPI) are not found, exactly as if they were not
installed (``importlib.util.find_spec`` says None, ``import`` raises ModuleNotFoundError)."""

import sys
from importlib.machinery import PathFinder

ABSENT = ("pandas", "matplotlib", "seaborn", "snakemake", "jsonschema", "scipy", "transformers",
          "mpi4py", "pyarrow", "tabulate", "jinja2", "pytest")  # fmt: skip


class _Bare(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            return None
        return PathFinder.find_spec(name, path, target)


sys.meta_path[:] = [_Bare if f is PathFinder else f for f in sys.meta_path]
