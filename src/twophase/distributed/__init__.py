"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on CUDA).

- ``sharding.py``: which heads / rows / vocabulary entries a rank holds, and its slice of every weight (no
  process group needed; the start-up check of the parallel size lives here).
- ``group.py``: the process groups of one engine, the collectives the model calls, and the per-step command
  that rank 0 broadcasts to the other ranks.
- ``layers.py``: row-parallel projections (one all-reduce), the vocab-parallel embedding, the gathered LM head.
- ``launch.py``: starting worker processes (torch.multiprocessing) or joining torchrun-style ranks and hosts.
"""
