"""Where two runs of the same seeded requests first part (issue 17's flake): the GPU test's prompts one at
a time, four runs through one graph engine (no run-ahead); at every token, the hash of each layer's key
and value at the newest cache position (the whole prompt's at the first token), so the first position
and layer whose numbers differ between runs is known, not only the first differing id. Part of
bench/gpu/determinism_h200.sh (run there also with CUBLAS_WORKSPACE_CONFIG set)."""
import os
import sys
import threading

import torch

sys.path.insert(0, "tests")
from test_engine_gpu import gpu_model_bf16, prompts  # noqa: E402

from model.engine import Engine, EngineConfig, SamplingParams  # noqa: E402


def h(t):
    return hash(t.float().cpu().numpy().tobytes())


engine = Engine(gpu_model_bf16(), EngineConfig(max_batch=16, run_ahead=False)).start()
params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=40, seed=0)


def one(prompt):
    """ids, and per token the per-layer (key, value) hashes at its newest cache position."""
    ids, kv, done = [], [], threading.Event()
    P = len(prompt)

    def sink(ev):  # runs in the engine thread, after the step that made the token
        if hasattr(ev, "id"):
            pos = slice(0, P) if not ids else slice(P + len(ids) - 1, P + len(ids))
            c = engine.cache
            kv.append([(h(k[0, :, pos]), h(v[0, :, pos])) for k, v in zip(c.k, c.v)])
            ids.append(ev.id)
        elif hasattr(ev, "reason"):
            done.set()
    engine.submit(prompt, params, sink)
    done.wait()
    return ids, kv


print(f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}", flush=True)
runs = [[one(p) for p in prompts()] for _ in range(4)]
engine.shutdown()
for j in range(1, len(runs)):
    for i, ((a, ka), (b, kb)) in enumerate(zip(runs[0], runs[j])):
        first_kv = next(((t, layer, "kv"[w]) for t, (x, y) in enumerate(zip(ka, kb))
                         for layer, (p, q) in enumerate(zip(x, y)) for w in range(2) if p[w] != q[w]), None)
        first_id = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first_kv or first_id is not None:
            print(f"run {j} vs 0, prompt {i} (len {len(prompts()[i])}): first id differing at token {first_id}; "
                  f"first cache entry differing (token, layer, k/v): {first_kv}", flush=True)
print(f"runs equal: {[r == runs[0] for r in runs]}", flush=True)
