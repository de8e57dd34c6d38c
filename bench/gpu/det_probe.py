"""Which part of the graph engine is not bitwise repeatable: the compiled prefill (600 tokens in two
chunks), a compiled decode forward, or a graph replay (sampled ids for fixed inputs); and whether
the stale keys and values past a row's length (masked, but read by a graph's slot bucket) change the
result. Part of bench/gpu/determinism_h200.sh."""
import sys

import torch

sys.path.insert(0, "tests")
from test_engine_gpu import gpu_model_bf16, prompts  # noqa: E402

from model.engine import Engine, EngineConfig  # noqa: E402


def h(t):
    return hash(t.float().cpu().numpy().tobytes())


engine = Engine(gpu_model_bf16(), EngineConfig(max_batch=16)).start()
engine.shutdown()
m, cache = engine.model, engine.cache
p = torch.tensor([prompts()[8]], device="cuda")
view = cache.view(0, 1)
with torch.inference_mode():
    pre, kv = set(), set()
    for _ in range(6):
        view.lengths.zero_()
        m(p[:, :512], kv_cache=view, kv_len=512)
        logits = m(p[:, 512:], kv_cache=view, kv_len=600)
        pre.add(h(logits)); kv.add(h(cache.k[3][0, :, :600]))
    print(f"prefill: {len(pre)} distinct logits, {len(kv)} distinct layer-3 keys of 6 runs", flush=True)
    saved = [t[0].clone() for t in cache.k + cache.v]
    dec = set()
    for _ in range(6):
        for t, s in zip(cache.k + cache.v, saved):
            t[0].copy_(s)
        view.lengths.fill_(600)
        dec.add(h(m(torch.tensor([[7]], device="cuda"), kv_cache=view, kv_len=1024)))
    print(f"compiled decode forward at 1024 slots: {len(dec)} distinct logits of 6", flush=True)
    # the same, but the slots past the 601 filled ones (masked) hold different stale values each time,
    # as after other requests: the graph path reads up to its slot bucket, the eager path only kv_len
    def stale_runs(kv_len):
        """Logits of the step at 1024 / exactly 601 slots, other random values past slot 600 each time."""
        out = set()
        for i in range(6):
            for t, s in zip(cache.k + cache.v, saved):
                t[0].copy_(s)
                t[0, :, 601:].normal_(generator=torch.Generator("cuda").manual_seed(i))
            view.lengths.fill_(600)
            out.add(h(m(torch.tensor([[7]], device="cuda"), kv_cache=view, kv_len=kv_len)))
        return len(out)
    print(f"compiled decode forward at 1024 slots, other stale values past the length: {stale_runs(1024)} distinct logits of 6", flush=True)
    print(f"decode forward at exactly 601 slots, other stale values past them: {stale_runs(601)} distinct logits of 6", flush=True)
    g = engine.graphs
    for kv_len, stale in ((601, False), (300, False), (601, True), (300, True)):
        ids = {}
        for u in (0.1, 0.3, 0.5, 0.7, 0.9):
            got = set()
            for r in range(6):
                for i, (t, s) in enumerate(zip(cache.k + cache.v, saved)):
                    t[0].copy_(s)
                    if stale:
                        t[0, :, kv_len:].normal_(generator=torch.Generator("cuda").manual_seed(100 * r + i))
                view.lengths.fill_(kv_len - 1)
                out, _ = g.step([7], [[1.0, 50, 0.9, u, 0.0, 0.0, -1.0]], kv_len)
                got.add(int(out[0]))
            ids[u] = sorted(got)
        print(f"graph replay at kv_len {kv_len}{', other stale values' if stale else ''}: ids per uniform (one each if repeatable): {ids}", flush=True)
