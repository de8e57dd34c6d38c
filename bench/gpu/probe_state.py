"""The cache state where the seeded-sampling flake showed (bench/results/h200-determinism-2026-12-04):
the GPU tests' longest prompt prefilled as the engine does it (its default chunk, then the rest),
then the decode positions after it fed fixed ids, one forward each. Shared by the determinism probes."""
import sys

import torch

sys.path.insert(0, "tests")
from test_engine_gpu import prompts  # noqa: E402

from model.engine import EngineConfig  # noqa: E402

LONG = prompts()[8]  # the tests' longest prompt, longer than the engine's default chunk
CHUNK = EngineConfig.prefill_chunk


def fill(model, cache, upto: int, device="cuda") -> None:
    """Prefill the long prompt into `cache` (one row; its length is reset first), then decode
    positions len(LONG)..upto-1, position p fed id p % 4096."""
    x = torch.tensor([LONG], device=device)
    cache.lengths.zero_()
    model(x[:, :CHUNK], kv_cache=cache, kv_len=CHUNK)
    model(x[:, CHUNK:], kv_cache=cache, kv_len=len(LONG))
    for p in range(len(LONG), upto):
        model(torch.tensor([[p % 4096]], device=device), kv_cache=cache, kv_len=p + 1)
