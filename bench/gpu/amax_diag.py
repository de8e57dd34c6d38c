import sys, torch
sys.path.insert(0, "tests")
import test_fp8_cast as t
from model.precision import fp8_cast
for M, N in ((64, 64), (100, 72), (130, 48), (16, 2050), (1, 48), (48, 1)):
    x = t._hard_input(M, N, torch.bfloat16, "cuda")
    h = t._hard_input(M, N, torch.bfloat16, "cuda").flip(0) / 8
    for fmt in t.FORMATS:
        s = torch.tensor(3.5, device="cuda")
        q, qt, am = fp8_cast.cast_transpose(x, s, fmt, "srelu_grad", h)
        r, rt, ram = fp8_cast._reference(x, s, fmt, "srelu_grad", h)
        a = fp8_cast.activate(x, "srelu_grad", h)
        i = a.abs().argmax()
        print(M, N, fmt, "kernel amax", am.item(), "torch", ram.item(), "at", divmod(i.item(), N), "x", x.view(-1)[i].item(), "h", h.view(-1)[i].item(),
              "q ok", torch.equal(q.view(torch.uint8), r.view(torch.uint8)), "qt ok", torch.equal(qt.view(torch.uint8), rt.view(torch.uint8)))
        bad = (q.view(torch.uint8) != r.view(torch.uint8)).nonzero()[:3].tolist()
        for bi, bj in bad:
            print("   bad", bi, bj, x[bi, bj].item(), h[bi, bj].item(), q[bi, bj].float().item(), r[bi, bj].float().item())
