"""bf16: the baseline. fp32 master weights; on CUDA the matmuls run in bf16 under autocast, on CPU in
fp32 (CPU bf16 matmuls are slower than fp32 on most machines, and the baseline should be exact there)."""
from __future__ import annotations

from .base import PrecisionBackend


class BF16Backend(PrecisionBackend):
    name = "bf16"
