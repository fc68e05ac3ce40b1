"""Fused elementwise kernels for the hot path (Triton on CUDA, torch reference elsewhere).

At decode batch sizes a layer's matmuls read megabytes while each small op is one launch of a
few microseconds; fusing the norm, rotary and activation ops keeps a layer at ~10 launches.
Each op dispatches to Triton only on CUDA tensors outside autograd (training runs the
reference, which has a backward), and each has a torch reference the tests compare with.
"""

from specserve.ops.fused import argmax, qk_norm_, rms_norm, rope_, silu_and_mul

__all__ = ["argmax", "qk_norm_", "rms_norm", "rope_", "silu_and_mul"]
