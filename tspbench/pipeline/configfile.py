"""The settings-file helpers, where the pipeline first had them: they live in
:mod:`tspbench.core.configfile`, the lowest layer, so projection configs (the plan maps) are read
and checked by the same code as sweep configs."""

from tspbench.core.configfile import check_schema, non_finite, read_yaml

__all__ = ["check_schema", "non_finite", "read_yaml"]
