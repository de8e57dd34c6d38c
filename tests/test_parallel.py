"""The parts of scaling out that need no multi-process stage run (tests/test_scale_out.py runs those):

- a stage started by torchrun, srun or mpirun joins that job (their variables become torch's); srun's
  batch script (no job step) and a plain process do not; srun/mpirun without a meeting point is refused;
- the runtime keys give torchrun's static rendezvous on several machines, --standalone on one;
- batches are numbered in the single-process order: a step reads the same rows on 1, 2 or 4 ranks, a
  position saved on one rank count resumes on another, and an evaluation of N batches counts exactly
  those N on any rank count;
- Muon under FSDP2 (2 gloo ranks, matrices whose rows do not split evenly, a fused q/k/v split across
  the shard boundary) gives the single-process update; clipping works on sharded gradients;
- a backend that cannot run under FSDP says so before any work.
"""
from __future__ import annotations

import re
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from model.precision import BackendUnavailable, get_backend
from pipeline.config import RuntimeParams
from pipeline.data import IGNORE, TokenStream
from pipeline.runtime import LaunchError, external_launcher, join_env, torchrun_command
from project_files import committed_params, run_on_params

ROOT = Path(__file__).resolve().parent.parent


# -- launch ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, want", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"},
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}),
    ({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"},
     {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node-0", "MASTER_PORT": "29400"}),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "MASTER_ADDR": "h", "MASTER_PORT": "1234"},
     {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"},
     {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "node-0", "MASTER_PORT": "29400"}),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "7"}, {}),  # sbatch's script, not a job step
    ({"PATH": "/bin"}, {}),
])
def test_a_launchers_job_is_joined(env, want):
    runtime = RuntimeParams(rdzv_endpoint="node-0:29400")
    assert join_env(runtime, env) == want
    assert (external_launcher(env) is None) == (want == {})


def test_srun_without_a_meeting_point_is_refused():
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0"}
    with pytest.raises(LaunchError, match="srun as rank 1 of 2.*MASTER_ADDR and MASTER_PORT.*runtime.rdzv_endpoint"):
        join_env(RuntimeParams(), env)
    assert join_env(RuntimeParams(), {**env, "SLURM_STEP_NUM_TASKS": "1"})["WORLD_SIZE"] == "1"  # alone: nothing to meet


def test_runtime_keys_give_the_torchrun_command():
    assert torchrun_command(RuntimeParams(), "pipeline.sft") is None
    one = torchrun_command(RuntimeParams(nproc=4), "pipeline.sft")
    assert one[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=4", "--max-restarts=0", "--standalone", "-m",
                       "pipeline.sft"]
    two = torchrun_command(RuntimeParams(nproc=2, nnodes=2, node_rank=1, rdzv_endpoint="spark-1:29500"), "pipeline.sft")
    assert two[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=0", "--nnodes=2",
                       "--node-rank=1", "--master-addr=spark-1", "--master-port=29500", "-m", "pipeline.sft"]


# -- the data order --------------------------------------------------------------------------------

def rows_of_step(world: int, step: int, batches_per_step: int, tokens: np.ndarray, start: dict | None = None) -> list:
    """Every row the ranks read in `step` (from a fresh stream, or from `start`), as sorted lists of ids."""
    streams = [TokenStream(tokens, 2, 8, r, world) for r in range(world)]
    for s in streams:
        if start:
            s.load_state(start)
        for _ in range(step * batches_per_step // world):
            s.next()
    return sorted(row for s in streams for _ in range(batches_per_step // world) for row in s.next()[0].tolist())


def test_a_step_reads_the_same_rows_on_any_rank_count():
    tokens = np.arange(1000, dtype=np.uint32)  # 62 batches of 2 x 8 an epoch: step 9 wraps into the next
    for step in (0, 3, 9):
        one = rows_of_step(1, step, 8, tokens)
        assert rows_of_step(2, step, 8, tokens) == one and rows_of_step(4, step, 8, tokens) == one


def test_a_position_resumes_on_another_rank_count():
    tokens = np.arange(1000, dtype=np.uint32)
    four = [TokenStream(tokens, 2, 8, r, 4) for r in range(4)]
    for s in four:
        for _ in range(20):  # 80 global batches: into the second epoch
            s.next()
    saved = four[0].state()
    assert all(s.state() == saved for s in four) and saved == {"pos": 80 - 62, "epoch": 1}
    assert rows_of_step(1, 0, 8, tokens, start=saved) == rows_of_step(4, 10, 8, tokens)
    assert rows_of_step(2, 0, 8, tokens, start=saved) == rows_of_step(4, 10, 8, tokens)


def test_an_evaluation_counts_the_same_batches_on_any_rank_count():
    tokens = np.arange(1000, dtype=np.uint32)
    counted = {}
    for world in (1, 2, 4):
        got = []
        for r in range(world):
            s = TokenStream(tokens, 2, 8, r, world)
            s.limit = 3  # three batches, however many ranks share them
            for _ in range(-(-3 // world)):
                x, y = s.next()
                if (y != IGNORE).any():
                    got += x.tolist()
        counted[world] = sorted(got)
    assert counted[1] == counted[2] == counted[4] and len(counted[1]) == 3 * 2


# -- FSDP: Muon, clipping, refusals ----------------------------------------------------------------

class Matrices(torch.nn.Module):
    """Matrices whose rows do not split evenly over 2 ranks (33 = 17 + 16), one of them a stack of
    three parts (20 + 10 + 6 rows) cut by the shard boundary, as the fused q/k/v projection is."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(24, 33, bias=False)
        self.b = torch.nn.Linear(33, 24, bias=False)
        self.qkv = torch.nn.Linear(24, 36, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum() + self.qkv(x).square().mean()


def _muon_steps(model, shard: bool) -> list[torch.Tensor]:
    from model.optim import Muon
    from model.parallel import shard as fsdp_shard
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    if shard:
        fsdp_shard(model, [model.a, model.b, model.qkv], torch.float32)
    opt = Muon(list(model.parameters()), lr=0.05, weight_decay=0.1, splits={model.qkv.weight: [20, 10, 6]})
    for step in range(3):
        x = torch.randn(4, 24, generator=torch.Generator().manual_seed(step))
        model(x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # sharded gradients: DTensors
        opt.step()
        opt.zero_grad()
    from model.parallel import full_matrix
    return [full_matrix(p.detach()).clone() for p in model.parameters()]


def _fsdp_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sharded = _muon_steps(Matrices(), shard=True)
    if rank == 0:
        torch.save(sharded, out)
    dist.destroy_process_group()


def test_muon_and_clipping_under_fsdp_equal_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(_fsdp_rank, args=(port, str(tmp_path / "w.pt")), nprocs=2, start_method="spawn")
    want = _muon_steps(Matrices(), shard=False)
    got = torch.load(tmp_path / "w.pt")
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_backend_that_cannot_shard_says_so_first(tmp_path):
    get_backend("bf16").check_parallel("fsdp")
    get_backend("fp8").check_parallel("fsdp")
    with pytest.raises(BackendUnavailable, match="te-fp8.*runtime.parallel=fsdp.*runtime.parallel=ddp.*bf16, fp8"):
        get_backend("te-fp8").check_parallel("fsdp")
    get_backend("te-fp8").check_parallel("ddp")
    # the stage refuses before reading anything or starting a process (no token files exist here)
    d = committed_params(ROOT)
    d["precision"]["backend"] = "te-fp8"
    d["runtime"].update(parallel="fsdp", nproc=2)
    r = run_on_params(ROOT, tmp_path, d, "pipeline.pretrain")
    assert r.returncode != 0 and "pretrain: precision backend 'te-fp8[delayed,fused]' does not run under " \
                                  "runtime.parallel=fsdp" in r.stderr, r.stderr
    assert "torch.distributed.run" not in r.stderr and not (tmp_path / "artifacts").exists()


def test_link_check_runs_over_the_ranks(tmp_path):
    """`sparkchat link-check` starts its ranks from the runtime keys, checks an all-reduce and times sizes."""
    d = committed_params(ROOT)
    d["runtime"].update(nproc=2, device="cpu")
    r = run_on_params(ROOT, tmp_path, d, "sparkchat.cli", "link-check", "--sizes-mb", "0.25", "1", "--iters", "2",
                      timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "link-check: 2 rank(s), backend gloo, all-reduce checked" in r.stdout
    assert f"rank 1: {socket.gethostname()} cpu" in r.stdout
    sizes = [line.split()[0] for line in r.stdout.splitlines() if re.match(r"\s+\d+\.\d+\s+\d", line)]
    assert sizes == ["0.25", "1.00"], r.stdout


@pytest.mark.parametrize("runtime, flag, message", [
    ({}, "1", "join: runtime.nnodes is 1 in params.yaml: there is no job of several machines to join"),
    ({"nnodes": 2, "rdzv_endpoint": "n0:29500"}, "0", "join: --node-rank 0 is the machine that runs the pipeline"),
    ({"nnodes": 2, "rdzv_endpoint": "n0:29500"}, "2", "join: --node-rank must be in 1..1 (runtime.nnodes=2), got 2"),
])
def test_join_refuses_what_cannot_be_joined(tmp_path, runtime, flag, message):
    d = committed_params(ROOT)
    d["runtime"].update(runtime)
    r = run_on_params(ROOT, tmp_path, d, "sparkchat.cli", "join", "--node-rank", flag)
    assert r.returncode != 0 and message in r.stderr, r.stderr
