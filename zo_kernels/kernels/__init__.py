"""Triton kernels (cast, pack, utils import triton; zo_kernels imports them only on first use) and the launch plan
of a bucket (plan: no triton, the CPU path uses it too)."""
