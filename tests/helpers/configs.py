"""Small sweep configs the pipeline tests share."""

# two strategies x two lengths on 2 local ranks: the smallest sweep that exercises every rule
MINI = {
    "name": "mini",
    "model": "tiny",
    "dtype": "fp32",
    "warmup": 0,
    "steps": 1,
    "gpus_per_node": 2,
    "launcher": "local",
    "sweeps": [
        {
            "name": "seq",
            "strategies": ["tsp", "tp"],
            "degrees": [2],
            "gpus": [2],
            "seq_lens": [32, 64],
            "batches": [1],
            "modes": ["train"],
        }
    ],
}
