"""tspbench: benchmark and reproducibility suite for folded Tensor-and-Sequence Parallelism (TSP).

Layers, one-way: ``tspbench.core`` (configs, reference model, kernels, zigzag, counted collectives)
<- strategies (``tsp_impl``, ``baselines``) <- harness (the rest of ``tspbench``).
"""

__version__ = "0.1.0"
