"""Which operator of the eager decode forward gives different bits for equal inputs? The forward over
1,024 cache slots runs again and again on one saved cache (`fill` of tests/test_engine_gpu.py; decode
positions 600-639, twenty in turn, or `--only P`), each repeat compared with the first at its position;
no engine is built (unless `--after-engine`), so SDPA may pick cuDNN's kernel. With every
module's inputs and outputs kept, for each differing repeat the first module whose inputs were equal
and outputs not. Results: bench/results/h200-determinism-2026-12-04b/ (cuDNN's SDPA kernel).

Options: `--ops` records every aten operator instead (a dispatch mode; prints the first few partings:
difference, and whether the inputs lay at the same addresses mod 256); `--sync` with it waits for every
operator to finish; `--bare` records nothing, only the logits compared; `--repeats N`; `--only P`;
`--backend cudnn|efficient|math` pins SDPA's kernel; `--after-engine` starts a CUDA-graph engine first;
`--deterministic` turns on torch's deterministic algorithms. SDPA replaced, to tell kernels apart:
`--explicit` / `--explicit-bf16` (matmuls and softmax in fp32 / bf16), `--fp32` (SDPA on fp32 copies),
`--float-mask`, `--full-mask`, `--pad-mask` (the mask as a bf16 bias, at (B, H, T, S), in a buffer
padded to 16 query rows), `--pad-q` (queries padded to 16 rows). Part of bench/gpu/determinism_h200.sh."""
import collections
import time
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, "tests")
from test_engine_gpu import fill, gpu_model_bf16  # noqa: E402

from model.engine import Engine, EngineConfig  # noqa: E402
from model.gpt import KVCache  # noqa: E402


def arg(name: str, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


N = int(arg("--repeats", 1000))
only = arg("--only")  # one decode position instead of twenty (run 8 found only 602 parting)
model = gpu_model_bf16()
if "--after-engine" in sys.argv:
    engine = Engine(gpu_model_bf16(), EngineConfig(max_batch=16)).start()
    engine.shutdown()
if "--deterministic" in sys.argv:
    torch.use_deterministic_algorithms(True, warn_only=True)
backend = arg("--backend")
backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
if backend:  # for the whole process (the context kept, or its collection would restore every backend)
    backend_ctx = sdpa_kernel([backends[backend]])
    backend_ctx.__enter__()
if "--explicit" in sys.argv or "--explicit-bf16" in sys.argv:
    # SDPA written out in operators (fp32, or in the inputs' bf16), so that --ops can name the one inside it
    up = "--explicit" in sys.argv

    def explicit_sdpa(q, k, v, attn_mask=None, **kw):
        q, k, v = (t.float() if up else t for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        return (scores.masked_fill(~attn_mask, float("-inf")).softmax(-1) @ v).to(torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention = explicit_sdpa
sdpa = torch.nn.functional.scaled_dot_product_attention
if "--float-mask" in sys.argv:  # the mask as an additive bf16 bias instead of booleans
    torch.nn.functional.scaled_dot_product_attention = lambda q, k, v, attn_mask=None, **kw: sdpa(
        q, k, v, attn_mask=torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~attn_mask, float("-inf")), **kw)
if "--full-mask" in sys.argv or "--pad-mask" in sys.argv:
    # an additive bias materialised at the full (B, H, T, S) shape; --pad-mask: in an allocation whose
    # query dimension is padded to 16 rows (cuDNN's tile), the bias a view of its first T rows
    def biased(q, k, v, attn_mask=None, **kw):
        B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        rows = -(-T // 16) * 16 if "--pad-mask" in sys.argv else T
        bias = torch.zeros((B, H, rows, S), dtype=q.dtype, device=q.device)
        bias[:, :, :T].masked_fill_(~attn_mask.expand(B, H, T, S), float("-inf"))
        return sdpa(q, k, v, attn_mask=bias[:, :, :T], **kw)
    torch.nn.functional.scaled_dot_product_attention = biased
if "--pad-q" in sys.argv:  # the queries padded to 16 rows (cuDNN's tile) with zeros, their mask rows all true
    def padded(q, k, v, attn_mask=None, **kw):
        B, H, T, D = q.shape
        rows = -(-T // 16) * 16
        qp = torch.zeros((B, H, rows, D), dtype=q.dtype, device=q.device)
        qp[:, :, :T] = q
        mask = torch.ones((B, 1, rows, k.shape[2]), dtype=torch.bool, device=q.device)
        mask[:, :, :T] = attn_mask
        return sdpa(qp, k, v, attn_mask=mask, **kw)[:, :, :T]
    torch.nn.functional.scaled_dot_product_attention = padded
if "--fp32" in sys.argv:  # SDPA on fp32 copies of its inputs
    torch.nn.functional.scaled_dot_product_attention = lambda q, k, v, **kw: sdpa(q.float(), k.float(), v.float(), **kw).to(q.dtype)
sync = "--sync" in sys.argv  # with --ops: wait for every operator to finish before the next starts
cache = KVCache(model.config, 1, 1024, "cuda", torch.bfloat16)
record: list = []


def tensors(x) -> list:
    return [t.detach().clone() for t in tree_leaves(x) if torch.is_tensor(t)]


def hook(name):
    def fn(mod, args, out):
        record.append((name, tensors(args), tensors(out), None))
    return fn


class Ops(TorchDispatchMode):
    """Every aten operator run, with copies of its tensor inputs and outputs (uninitialised ones skipped)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ins = tensors((args, kwargs))
        out = func(*args, **(kwargs or {}))
        if sync:
            torch.cuda.synchronize()
        if "empty" not in func.__name__:
            # where each input lies (address mod 256, shape, strides): a kernel's choice can depend on it
            layout = [(t.data_ptr() % 256, tuple(t.shape), t.stride()) for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)]
            record.append((func.__name__, ins, tensors(out), layout))
        return out


ops = "--ops" in sys.argv
if not ops and "--bare" not in sys.argv:  # --bare: only the logits compared
    for name, mod in model.named_modules():
        if name:
            mod.register_forward_hook(hook(name))
print(f"{' '.join(sys.argv[1:]) or 'no options'}: recording {'operators' if ops else 'modules'}", flush=True)
with torch.inference_mode():
    fill(model, cache, 640)
    saved = [t.clone() for t in cache.k + cache.v]
    first, culprits, differ = {}, collections.Counter(), 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(N):
        p = int(only) if only else 600 + 2 * (i % 20)
        for t, s in zip(cache.k + cache.v, saved):
            t.copy_(s)
        cache.lengths.fill_(p)
        record.clear()
        x = torch.tensor([[p % 4096]], device="cuda")
        if ops:
            with Ops():
                logits = model(x, kv_cache=cache, kv_len=1024)
        else:
            logits = model(x, kv_cache=cache, kv_len=1024)
        rec = list(record)
        if p not in first:
            first[p] = (logits, rec)
            continue
        if torch.equal(logits, first[p][0]):
            continue
        differ += 1
        for k, ((name, ins, out, lay), (_, ins0, out0, lay0)) in enumerate(zip(rec, first[p][1])):
            same_in = all(torch.equal(a, b) for a, b in zip(ins, ins0))
            bad = [j for j, (a, b) in enumerate(zip(out, out0)) if not torch.equal(a, b)]
            if same_in and bad:
                where = f"operator {k} of {len(rec)}" if ops else name.split('.')[-1] if name.startswith('blocks') else name
                culprits[f"{name if ops else ''} {where} (output {bad})".strip()] += 1
                if ops and sum(culprits.values()) <= 5:  # the first few in detail
                    gap = max((a.float() - b.float()).abs().max().item() for j, (a, b) in enumerate(zip(out, out0)) if j in bad)
                    print(f"repeat {i}, position {p}: {name}, largest output difference {gap:.3g}; inputs "
                          f"{'laid out as in the first' if lay == lay0 else f'laid out {lay} against {lay0}'}", flush=True)
                break
        else:
            culprits["(no module with equal inputs: between modules)"] += 1
torch.cuda.synchronize()
print(f"{(time.perf_counter() - t0) / N * 1e3:.2f} ms a repeat (with the hooks' copies)", flush=True)
print(f"{differ} of {N - len(first)} repeats differ; first module/operator with equal inputs and other outputs: {dict(culprits)}",
      flush=True)
