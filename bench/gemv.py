"""A candidate weight product for decode steps of a few rows, timed against cuBLAS by
bench/decode_kernels.py (`--parts sweep,weights`): y = x @ W.T with x (M <= MAX_ROWS, K), W (N, K).

At one to a few rows a decode step is a chain of small matrix-vector products (3-13 MB each at d20)
that cuBLAS runs at 0.7-2.4 TB/s of the H200's ~4.3. This Triton kernel gives each program a few whole
rows of W (no split, no atomics: a fixed summation order). Measured on the H200
(bench/results/h200-engine-2026-12-04c): at one row its best block shape beats cuBLAS on three of the
four d20 layer shapes by 0.4-1.3 us a product and loses on the MLP input and the head (60 us a step if
each shape took its best; not measured in a chain), and at 4 rows it wins only on the attention output.
Not adopted in the engine: a per-GPU table of block shapes for about 6% at one row.
"""
from __future__ import annotations

import functools

import torch

MAX_ROWS = 16  # rows padded to one tensor-core tile; past this, F.linear's GEMM kernels are the right tool


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(x, w, y, M, N, sxm, swn, sym, K: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, ROWS)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            wt = tl.load(w + n[:, None] * swn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
            xt = tl.load(x + m[:, None] * sxm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
            if ROWS == 1:
                acc += tl.sum(wt.to(tl.float32) * xt.to(tl.float32), axis=1)[None, :]
            else:
                acc = tl.dot(xt, tl.trans(wt), acc)
        tl.store(y + m[:, None] * sym + n[None, :], acc.to(y.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))

    return gemv


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int | None = None, block_k: int | None = None,
         num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x (..., K) with at most MAX_ROWS rows in all, w (N, K) contiguous: x @ w.T in x's dtype."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], w.shape[0]
    assert M <= MAX_ROWS and w.shape[1] == K and w.stride(-1) == 1
    rows = 1 if M == 1 else 16
    if block_n is None:  # the H200's best at one row for most d20 shapes (bench/decode_kernels.py --parts sweep)
        block_n, block_k, num_warps, num_stages = (2, 1024, 4, 2) if rows == 1 else (16, 256, 4, 4)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = ((N + block_n - 1) // block_n,)
    _kernel()[grid](x2, w, y, M, N, x2.stride(0), w.stride(0), y.stride(0), K=K,
                    BLOCK_N=block_n, BLOCK_K=block_k, ROWS=rows, num_warps=num_warps, num_stages=num_stages)
    return y.reshape(*x.shape[:-1], N)
