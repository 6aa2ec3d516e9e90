# The repo-wide pytest setup: the multi-rank fixtures from mega-core's testing helpers.
import os

import torch

pytest_plugins = ["mega.testing.fixtures"]

# One intra-op thread in the test process, as each rank of a test world has: the tests' models
# are tiny, and on a 2-core machine whose other core runs a world's ranks, a second OpenMP thread
# spins waiting for it (a tiny linear layer took 9 ms instead of microseconds under load).
torch.set_num_threads(1)
# Runs the tests start as processes (mega train, torchrun) likewise: their numbers then match the
# in-process references bit for bit (the thread count changes the order of float sums).
os.environ["OMP_NUM_THREADS"] = "1"
