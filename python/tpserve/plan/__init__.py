"""``python -m tpserve plan``: choose the tensor-parallel (TP) and data-parallel (DP) split of a
model over a machine from a cost model (seed 003's communication model plus the roofline the
benchmarks measure), before buying GPUs or launching a server."""
