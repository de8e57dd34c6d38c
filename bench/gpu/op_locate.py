"""Which operator of the eager decode forward gives different bits for equal inputs? replay_stress.py
(run4) found the eager forward over 1,024 cache slots not repeatable (20 of 980 repeats on one saved
cache) while every weight product and SDPA alone were. Here, in a process of its own, that forward
runs again and again on the saved cache with every module's inputs and outputs kept; for each repeat
that differs from the first at its position, the first module whose inputs were equal and outputs not.
`--after-engine` first starts a CUDA-graph engine on the same model (its captures stay alive), to see
whether their presence matters; `--backend cudnn|efficient|math` runs SDPA on that backend only;
`--ops` records every aten operator's inputs and outputs instead of every module's (a dispatch mode),
naming the operator itself (not run on a GPU yet). Part of bench/gpu/determinism_h200.sh."""
import collections
import time
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, "tests")
from test_engine_gpu import gpu_model_bf16  # noqa: E402

from model.engine import Engine, EngineConfig  # noqa: E402
from model.gpt import KVCache  # noqa: E402
from probe_state import fill  # noqa: E402

N = 1000
model = gpu_model_bf16()
if "--after-engine" in sys.argv:
    engine = Engine(gpu_model_bf16(), EngineConfig(max_batch=16)).start()
    engine.shutdown()
if "--deterministic" in sys.argv:
    torch.use_deterministic_algorithms(True, warn_only=True)
backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else None
backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
if backend:
    sdpa_kernel([backends[backend]]).__enter__()  # for the whole process
cache = KVCache(model.config, 1, 1024, "cuda", torch.bfloat16)
record: list = []


def tensors(x) -> list:
    return [t.detach().clone() for t in tree_leaves(x) if torch.is_tensor(t)]


def hook(name):
    def fn(mod, args, out):
        record.append((name, tensors(args), tensors(out)))
    return fn


class Ops(TorchDispatchMode):
    """Every aten operator run, with copies of its tensor inputs and outputs (uninitialised ones skipped)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ins = tensors((args, kwargs))
        out = func(*args, **(kwargs or {}))
        if "empty" not in func.__name__:
            record.append((func.__name__, ins, tensors(out)))
        return out


ops = "--ops" in sys.argv
if not ops:
    for name, mod in model.named_modules():
        if name:
            mod.register_forward_hook(hook(name))
print(f"after engine: {'--after-engine' in sys.argv}, deterministic algorithms: {'--deterministic' in sys.argv}, "
      f"SDPA backend: {backend or 'default'}, recording {'operators' if ops else 'modules'}", flush=True)
with torch.inference_mode():
    fill(model, cache, 640)
    saved = [t.clone() for t in cache.k + cache.v]
    first, culprits, differ = {}, collections.Counter(), 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(N):
        p = 600 + 2 * (i % 20)
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
        for (name, ins, out), (_, ins0, out0) in zip(rec, first[p][1]):
            same_in = all(torch.equal(a, b) for a, b in zip(ins, ins0))
            bad = [j for j, (a, b) in enumerate(zip(out, out0)) if not torch.equal(a, b)]
            if same_in and bad:
                culprits[f"{name.split('.')[-1] if name.startswith('blocks') else name} (output {bad})"] += 1
                break
        else:
            culprits["(no module with equal inputs: between modules)"] += 1
torch.cuda.synchronize()
print(f"{(time.perf_counter() - t0) / N * 1e3:.2f} ms a repeat (with the hooks' copies)", flush=True)
print(f"{differ} of {N - len(first)} repeats differ; first module/operator with equal inputs and other outputs: {dict(culprits)}",
      flush=True)
