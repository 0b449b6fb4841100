"""Triton attention kernels for CUDA, each held to its torch reference in kernels/attention.py."""
