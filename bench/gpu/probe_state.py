"""The cache state where the seeded-sampling flake showed (bench/results/h200-determinism-2026-12-04):
the GPU tests' 600-token prompt prefilled as the engine does it (a 512-id chunk, then the rest), then
decode positions 600.. fed fixed ids, one forward each. Shared by the determinism probes."""
import sys

import torch

sys.path.insert(0, "tests")
from test_engine_gpu import prompts  # noqa: E402

PROMPT = 600  # prompts()[8]'s length


def fill(model, cache, upto: int, device="cuda") -> None:
    """Prefill the 600-token prompt into `cache` (one row; its length is reset first), then decode
    positions 600..upto-1, position p fed id p % 4096."""
    x = torch.tensor([prompts()[8]], device=device)
    assert x.shape[1] == PROMPT
    cache.lengths.zero_()
    model(x[:, :512], kv_cache=cache, kv_len=512)
    model(x[:, 512:], kv_cache=cache, kv_len=PROMPT)
    for p in range(PROMPT, upto):
        model(torch.tensor([[p % 4096]], device=device), kv_cache=cache, kv_len=p + 1)
