"""Test-session settings shared by every module."""

import os

# Several processes (pytest, Ray replicas) share CI's 2 cores: one intra-op thread each
# avoids the oversubscription that makes small CPU matmuls tens of times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    # Triton kernels then run in Triton's interpreter on CPU tensors (tests/kernels/test_kernels.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")
