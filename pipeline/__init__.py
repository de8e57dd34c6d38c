"""The sparkchat DVC pipeline: one module per stage (run as `python -m pipeline.<stage>`) plus what
stages share (config, data loading, training loop, checkpoints, metrics). Knows nothing of HTTP."""
import os as _os
import platform as _platform

# The same bytes from the same inputs on any x86 CPU: MKL and ATen pick their kernels by the CPU's
# instruction set (AVX-512 where there is one), and kernels of different widths sum in different orders.
# Pinned to AVX2, which every x86 CPU of the last decade has; set before torch loads, and only where unset,
# so a user can choose otherwise. (On this project's 2-core AMD EPYC both are what it picks by itself.)
if _platform.machine().lower() in ("x86_64", "amd64"):
    _os.environ.setdefault("MKL_CBWR", "AVX2")
    _os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
