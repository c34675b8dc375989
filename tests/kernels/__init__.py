"""Kernels against their torch references (Triton's interpreter on CPU)."""
