"""`sparkchat link-check`: are the machines of a job connected, and how fast is the link?

Starts like a training stage (the `runtime` keys of params.yaml, relaunching under torchrun; or joining
the torchrun/srun/mpirun job that started it), then on every rank: an all-reduce whose result is checked
(the sum of every rank's number), and timed all-reduces of growing sizes (NCCL on GPUs, gloo on CPUs).
Rank 0 prints every rank's machine and device, then per size the time and the bandwidths in
nccl-tests' terms: algbw = bytes / time, busbw = algbw x 2 (n - 1) / n, the rate each link carries in a
ring (compare busbw with the link: 200 Gb/s ConnectX-7 between two DGX Sparks is 25 GB/s).

    sparkchat link-check                       # on node 0, params.yaml's runtime keys
    sparkchat link-check --node-rank 1         # on node 1 (a project directory both machines share)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import time


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sparkchat link-check", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--params", default="params.yaml", help="params file whose runtime keys describe the job")
    ap.add_argument("--node-rank", type=int, default=None,
                    help="this machine's rank, instead of runtime.node_rank (default: runtime.node_rank)")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 128, 512], help="all-reduce sizes, MiB")
    ap.add_argument("--iters", type=int, default=10, help="timed all-reduces per size (after 2 untimed)")
    return ap


def check_link(sizes_mb: list[float], iters: int, timeout_s: int, device_name: str) -> list[dict]:
    import torch
    import torch.distributed as dist

    from .runtime import resolve_device, setup_distributed
    rank, world, device = setup_distributed(resolve_device(device_name), timeout_s, always=True)
    where = f"{socket.gethostname()} {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    seen = [None] * world
    dist.all_gather_object(seen, where)
    x = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(x)
    want = world * (world + 1) / 2
    if x.item() != want:
        raise RuntimeError(f"all-reduce gave {x.item()}, expected {want}: the link corrupts data")
    rows = []
    for mb in sizes_mb:
        t = torch.ones(max(1, int(mb * 2 ** 20 / 4)), device=device)
        for _ in range(2):
            dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = (time.perf_counter() - t0) / iters
        algbw = t.numel() * 4 / dt / 1e9
        rows.append(dict(mib=mb, ms=dt * 1e3, algbw_gbs=algbw, busbw_gbs=algbw * 2 * (world - 1) / world))
    if rank == 0:
        print(f"link-check: {world} rank(s), backend {dist.get_backend()}, all-reduce checked", flush=True)
        for r, w in enumerate(seen):
            print(f"  rank {r}: {w}", flush=True)
        print(f"  {'MiB':>8} {'ms':>10} {'algbw GB/s':>12} {'busbw GB/s':>12}", flush=True)
        for row in rows:
            print(f"  {row['mib']:8.2f} {row['ms']:10.3f} {row['algbw_gbs']:12.2f} {row['busbw_gbs']:12.2f}", flush=True)
    dist.destroy_process_group()
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    from .config import ConfigError, load_params
    from .runtime import LaunchError, launch
    try:
        p = load_params(a.params)
        runtime = p.runtime
        if a.node_rank is not None:
            runtime = dataclasses.replace(runtime, node_rank=a.node_rank)  # checked again on construction
        env_names = [k for k in os.environ if k.startswith(("NCCL_", "GLOO_"))]
        if env_names and int(os.environ.get("RANK", 0)) == 0:
            print("link-check: " + ", ".join(f"{k}={os.environ[k]}" for k in sorted(env_names)), file=sys.stderr)
        launch(runtime, "pipeline.linkcheck", lambda: check_link(a.sizes_mb, a.iters, runtime.timeout_s,
                                                                 runtime.device), args=argv)
    except (ConfigError, LaunchError) as e:
        raise SystemExit(f"link-check: {e}") from None


if __name__ == "__main__":
    main()
