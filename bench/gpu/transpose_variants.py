"""Which way of writing the transposed FP8 tile Triton gets right on this GPU (H200, Triton 3.6:
a uint8 tl.trans was right for one bf16 input and wrong for fp32 tiles and for two bf16 inputs).
Each variant casts act(x) (act: none, relu^2, x * 2 relu(h)) to FP8 and writes q and q^T; printed:
bit-exact against torch or not, per variant, act, format and tile shape.

    python bench/gpu/transpose_variants.py
"""
import torch
import triton
import triton.language as tl

from model.precision import fp8_cast


@triton.jit
def _act(x_ptr, h_ptr, offs, mask, ACT: tl.constexpr):
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:
        r = tl.maximum(x, 0.0)
        x = r * r
    elif ACT == 2:
        h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = x * (2 * tl.where(h > 0, h, 0.0))
    return x


@triton.jit
def _kernel(x_ptr, h_ptr, scale, q_ptr, qt_ptr, M, N, fmax, ACT: tl.constexpr, OUT: tl.constexpr,
            MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    x = _act(x_ptr, h_ptr, offs, mask, ACT)
    y = tl.minimum(tl.maximum(x * scale, -fmax), fmax)
    q = y.to(OUT).to(tl.uint8, bitcast=True)
    tl.store(q_ptr + offs, q, mask=mask)
    mask_t = (cols[:, None] < N) & (rows[None, :] < M)
    offs_t = cols[:, None] * M + rows[None, :]
    if MODE == 0:  # uint8 tl.trans (the op's kernel)
        tl.store(qt_ptr + offs_t, tl.trans(q), mask=mask_t)
    elif MODE == 1:  # transposed pointers: the tile re-read in (col, row) order, Triton converts layouts
        xt = _act(x_ptr, h_ptr, rows[None, :] * N + cols[:, None], mask_t, ACT)
        yt = tl.minimum(tl.maximum(xt * scale, -fmax), fmax)
        tl.store(qt_ptr + offs_t, yt.to(OUT).to(tl.uint8, bitcast=True), mask=mask_t)
    elif MODE == 2:  # fp32 tl.trans, then cast
        tl.store(qt_ptr + offs_t, tl.trans(y).to(OUT).to(tl.uint8, bitcast=True), mask=mask_t)
    else:  # uint8 stored through transposed pointers of q's own tile
        tl.store(qt_ptr + cols[None, :] * M + rows[:, None], q, mask=mask)


def main():
    g = torch.Generator().manual_seed(0)
    for M, N in ((64, 64), (130, 200)):
        x = (torch.randn(M, N, generator=g) * 40).bfloat16().cuda()
        h = (torch.randn(M, N, generator=g) * 5).bfloat16().cuda()
        for mode in range(4):
            for act in (0, 1, 2):
                for fmt, out in ((torch.float8_e4m3fn, tl.float8e4nv), (torch.float8_e5m2, tl.float8e5)):
                    for bm, bn, w in ((64, 64, 4), (128, 128, 8), (64, 256, 8)):
                        q = torch.empty(M, N, dtype=torch.uint8, device="cuda")
                        qt = torch.empty(N, M, dtype=torch.uint8, device="cuda")
                        _kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
                            x, h, 0.5, q, qt, M, N, torch.finfo(fmt).max, ACT=act, OUT=out, MODE=mode,
                            BM=bm, BN=bn, num_warps=w)
                        r, rt, _ = fp8_cast._reference(x, torch.tensor(0.5, device="cuda"), fmt,
                                                       list(fp8_cast.ACTS)[act], h if act == 2 else None)
                        ok_q = torch.equal(q, r.view(torch.uint8))
                        ok_t = torch.equal(qt, rt.view(torch.uint8))
                        print(f"{M}x{N} mode {mode} act {act} {str(fmt)[-6:]} {bm}x{bn}/{w}: "
                              f"q {'ok' if ok_q else 'WRONG'} qt {'ok' if ok_t else 'WRONG'}")


if __name__ == "__main__":
    main()
