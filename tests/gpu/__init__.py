"""CUDA-only tests (marked gpu; run on the GPU machine)."""
