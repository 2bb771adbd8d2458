"""Small sweep configs the pipeline tests share."""

import yaml

from tests.helpers.runner import ROOT

# two strategies x two lengths on 2 local ranks: the smallest sweep that exercises every rule
# (the workflow catalog's test config, which `snakemake --directory .test` runs)
MINI = yaml.safe_load((ROOT / ".test/config/config.yaml").read_text())

# Llama 3.1's RoPE scaling with an original context short enough that it changes the tiny
# model's rotations at the test lengths (head dim 8: three of its four frequencies)
LLAMA3_ROPE_TINY = (
    "llama3,factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=16"
)

# YaRN (Qwen2.5's long-context scaling) with the same short original context
YARN_ROPE_TINY = "yarn,factor=4,original_max_position_embeddings=16"
