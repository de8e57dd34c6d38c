"""Training across "machines" on this CPU: gloo on loopback, a tiny model, the real pretrain stage.

Two "nodes" of two processes each are two torchrun agents in one project directory (the shared
filesystem of a real multi-machine job):
- DDP, node 0 started from the runtime keys (the stage relaunches itself under torchrun) and node 1 by
  an external `torchrun` (the stage joins instead of relaunching): every step's loss equals one
  process's with the same global batch (fp32, relative difference <= 1e-5);
- FSDP, both nodes external torchruns: the same;
- kill -9 of one rank of an FSDP job: every rank and both agents exit non-zero within 60 s; the next
  `dvc repro` (node 0 under DVC, node 1 by `sparkchat join`) resumes and ends bit-exactly where the
  unbroken job ended (loss plot and model weights);
- the checkpoint those 4 ranks wrote resumes on 2 ranks and on 1, with the unbroken job's next-step loss.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sparkchat import paths
from test_pipeline_e2e import TINY, deep_update, dvc, env, make_project

pytestmark = pytest.mark.slow
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# every pretrain value is set before the data is made: the prepare stage reads the pretrain section
# (its token budget), so changing it later would remake the data; the runs differ only in `runtime`
PRETRAIN = {"steps": 12, "total_batch_tokens": 2048, "device_batch": 8, "eval_every": 6, "eval_tokens": 1024,
            "checkpoint_every": 3, "log_every": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def data_project(tmp_path_factory) -> Path:
    """A project whose token files DVC has made (params, prepare, tokenizer, tokenize)."""
    proj = make_project(tmp_path_factory.mktemp("scale"), deep_update(json.loads(json.dumps(TINY)),
                                                                       {"pretrain": PRETRAIN}))
    dvc(proj, "repro", "tokenize")
    return proj


def copy_project(src: Path, dst: Path, **runtime) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    params = yaml.safe_load((dst / "params.yaml").read_text())
    params["runtime"].update(runtime)
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return dst


def node(proj: Path, rank: int, port: int, log: Path) -> subprocess.Popen:
    """A "machine" of two ranks started by an external torchrun."""
    cmd = TORCHRUN + ["--nnodes=2", f"--node-rank={rank}", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                      f"--master-port={port}", "--max-restarts=0", "-m", "pipeline.pretrain"]
    return subprocess.Popen(cmd, cwd=proj, env=env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def finish(*procs: subprocess.Popen, timeout: float = 300) -> list[int]:
    return [p.wait(timeout=timeout) for p in procs]


def losses(proj: Path) -> dict[int, float]:
    rows = (proj / paths.plot_file("pretrain")).read_text().splitlines()[1:]
    return {int(r.split("\t")[0]): float(r.split("\t")[1]) for r in rows}


def assert_close_losses(got: dict, want: dict, steps=None) -> None:
    for step in steps or want:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])


def model_hash(proj: Path) -> str:
    return hashlib.sha256((proj / paths.MODEL_DIRS["pretrain"] / "model.safetensors").read_bytes()).hexdigest()


def run_stage(proj: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "pipeline.pretrain"], cwd=proj, env=env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r


@pytest.fixture(scope="module")
def one_process(data_project, tmp_path_factory) -> dict:
    proj = copy_project(data_project, tmp_path_factory.mktemp("one") / "proj")
    run_stage(proj)
    return losses(proj)


def test_ddp_on_two_nodes_equals_one_process(data_project, one_process, tmp_path):
    port = free_port()
    proj = copy_project(data_project, tmp_path / "proj", nproc=2, nnodes=2, node_rank=0,
                        rdzv_endpoint=f"127.0.0.1:{port}")
    # node 0 from the runtime keys: the stage starts torchrun itself
    first = subprocess.Popen([sys.executable, "-m", "pipeline.pretrain"], cwd=proj, env=env(),
                             stdout=(tmp_path / "node0.log").open("w"), stderr=subprocess.STDOUT)
    second = node(proj, 1, port, tmp_path / "node1.log")  # node 1: an external torchrun, which it joins
    assert finish(first, second) == [0, 0], (tmp_path / "node0.log").read_text()[-3000:]
    log0, log1 = (tmp_path / "node0.log").read_text(), (tmp_path / "node1.log").read_text()
    assert f"2 process(es) on machine 0 of 2, meeting at 127.0.0.1:{port}" in log0
    assert "12 steps x 1 micro-steps x 8x64 tokens x 4 rank(s)" in log0 and ", DDP" in log0
    assert "process(es) on" not in log1 and "pretrain: done" not in log1  # joined; rank 0 reports
    got = losses(proj)
    assert sorted(got) == sorted(one_process) == list(range(1, 13))
    assert_close_losses(got, one_process)


@pytest.fixture(scope="module")
def fsdp_unbroken(data_project, tmp_path_factory) -> Path:
    proj = copy_project(data_project, tmp_path_factory.mktemp("fsdp") / "proj", parallel="fsdp")
    port, logs = free_port(), tmp_path_factory.mktemp("fsdp_logs")
    procs = [node(proj, r, port, logs / f"node{r}.log") for r in (0, 1)]
    assert finish(*procs) == [0, 0], (logs / "node0.log").read_text()[-3000:]
    assert "x 4 rank(s)" in (logs / "node0.log").read_text()
    assert not list((proj / paths.checkpoint_dir("pretrain")).glob("*.dcp*")), "a finished stage keeps its checkpoint"
    return proj


def test_fsdp_on_two_nodes_equals_one_process(fsdp_unbroken, one_process):
    got = losses(fsdp_unbroken)
    assert sorted(got) == list(range(1, 13))
    assert_close_losses(got, one_process)


def _children(pid: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def killed(data_project, tmp_path_factory) -> dict:
    """An FSDP job on 2 x 2 ranks, one of node 1's ranks killed with SIGKILL once a checkpoint is in."""
    proj = copy_project(data_project, tmp_path_factory.mktemp("killed") / "proj", parallel="fsdp")
    port, logs = free_port(), tmp_path_factory.mktemp("killed_logs")
    procs = [node(proj, r, port, logs / f"node{r}.log") for r in (0, 1)]
    committed = proj / paths.checkpoint_dir("pretrain") / "last.dcp.sha256"
    deadline = time.time() + 300
    while not committed.exists() and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.05)
    assert committed.exists(), (logs / "node0.log").read_text()[-3000:]
    workers = [w for p in procs for w in _children(p.pid)]
    assert len(workers) == 4
    victim = _children(procs[1].pid)[-1]
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    rcs = finish(*procs, timeout=120)
    took = time.time() - t0
    time.sleep(0.5)  # the agents reap their workers as they exit
    return {"proj": proj, "rcs": rcs, "seconds": took, "survivors": [w for w in workers if _alive(w)],
            "reports": [(logs / f"node{r}.log").read_text() for r in (0, 1)]}


def test_kill9_of_one_rank_ends_every_rank(killed):
    assert all(rc != 0 for rc in killed["rcs"]), killed["rcs"]
    assert killed["seconds"] < 60, f"the job took {killed['seconds']:.0f} s to end after the kill"
    assert killed["survivors"] == []
    # torchrun's report on each machine: both of its ranks ended non-zero (the killed one by SIGKILL,
    # the others by the error their collective raised, or by the agent's SIGTERM)
    codes = [int(c) for report in killed["reports"] for c in re.findall(r"^\s+exitcode\s*:\s*(-?\d+)", report, re.M)]
    assert len(codes) == 4 and all(codes) and -9 in codes, codes


def resumed_step(log: str) -> int:
    m = re.search(r"resuming from checkpoint at step (\d+) \(sharded, on (\d+) rank\(s\)\)", log)
    assert m, log[-3000:]
    return int(m.group(1))


def test_dvc_repro_resumes_bit_exactly(killed, fsdp_unbroken, tmp_path):
    port = free_port()
    proj = copy_project(killed["proj"], tmp_path / "proj", nproc=2, nnodes=2, node_rank=0,
                        rdzv_endpoint=f"127.0.0.1:{port}")
    repro = subprocess.Popen(["dvc", "repro", "pretrain"], cwd=proj, env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    # node 1 as a user runs it: `sparkchat join` takes its part of whatever stage node 0 starts
    second = subprocess.Popen([sys.executable, "-m", "sparkchat.cli", "join", "--node-rank", "1", "--once"], cwd=proj,
                              env=env(), stdout=(tmp_path / "node1.log").open("w"), stderr=subprocess.STDOUT)
    out = repro.communicate(timeout=300)[0]
    assert repro.returncode == 0 and second.wait(timeout=60) == 0, out[-3000:] + (tmp_path / "node1.log").read_text()[-2000:]
    assert resumed_step(out) >= 3
    plot = paths.plot_file("pretrain")
    assert (proj / plot).read_text() == (fsdp_unbroken / plot).read_text()
    assert model_hash(proj) == model_hash(fsdp_unbroken)


@pytest.mark.parametrize("nproc", [2, 1])
def test_a_four_rank_fsdp_checkpoint_resumes_on_fewer(killed, fsdp_unbroken, tmp_path, nproc):
    proj = copy_project(killed["proj"], tmp_path / "proj", nproc=nproc)  # one machine
    r = run_stage(proj)
    step = resumed_step(r.stderr)
    assert f"(sharded, on {nproc} rank(s))" in r.stderr
    want = losses(fsdp_unbroken)
    got = losses(proj)
    assert sorted(got) == list(range(1, 13))
    assert_close_losses(got, want, steps=[step + 1])  # the next step after the checkpoint
    assert_close_losses(got, want)  # and every later one


def test_machines_without_a_shared_folder_are_refused(data_project, tmp_path):
    """Two "machines" each in a project directory of its own (separate disks): every rank stops at start,
    naming the machine that cannot see node 0's files, instead of training into checkpoints no one can
    read back whole."""
    port = free_port()
    dirs = [copy_project(data_project, tmp_path / f"disk{r}" / "proj", parallel="fsdp") for r in (0, 1)]
    procs = []
    for r, proj in enumerate(dirs):
        cmd = TORCHRUN + ["--nnodes=2", f"--node-rank={r}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                          f"--master-port={port}", "--max-restarts=0", "-m", "pipeline.pretrain"]
        procs.append(subprocess.Popen(cmd, cwd=proj, env=env(), stdout=(tmp_path / f"node{r}.log").open("w"),
                                      stderr=subprocess.STDOUT))
    assert all(rc != 0 for rc in finish(*procs, timeout=180))
    log = (tmp_path / "node1.log").read_text()
    assert f"{socket.gethostname()} cannot see the files rank 0 writes in " \
           f"{dirs[0] / paths.checkpoint_dir('pretrain')}" in log.replace("\n", ""), log[-3000:]
    assert not (dirs[0] / paths.MODEL_DIRS["pretrain"]).exists()
