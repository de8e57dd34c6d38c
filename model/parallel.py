"""Spreading a GPT over ranks with torch's own engines: DDP, or FSDP2 (`fully_shard`).

- DDP: every rank holds the whole model, its gradients and its optimizer state; gradients are averaged
  by all-reduce during the backward of a step's last micro-step (the training loop skips the sync on the
  others), and every rank runs the same optimizer step.
- FSDP2: `fully_shard` on every block, then on the root (embedding and head). Each rank keeps 1/world
  of every weight (rows of dim 0, as DTensors), of its gradient and of its optimizer state. A block's
  weights are all-gathered just before its forward and again for its backward, and its gradients are
  reduce-scattered (averaged) right after: every micro-step, so gradients never exist unsharded for
  longer than one block's backward. The shards are the fp32 master weights; forward and backward run
  in the precision backend's compute dtype (`MixedPrecisionPolicy`: bf16 on CUDA, fp32 on CPU) and
  gradients reduce in fp32.

A precision backend converts the model before either wrapper: its Linears keep the model's weight
Parameters, so FSDP shards them like any other and gathers them (in the compute dtype) before the
converted forward casts them to FP8. Backends built on modules of their own (Transformer Engine) do not
run under FSDP here and say so before any work (`PrecisionBackend.supports_fsdp`).

Muon needs whole matrices: `full_matrix` gathers a sharded one and `local_rows` takes this rank's rows
of the update back (model/optim.py explains the choice).
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


def ddp(model: nn.Module, device: torch.device) -> nn.Module:
    # no buffer sync each forward: it would hand every rank rank 0's fp8 amax histories; the backend
    # reduces those itself (sync_ranks), and the other buffers (RoPE tables) agree already. torch
    # 2.13 renamed the switch (forward_sync_buffers); 2.11 knows only broadcast_buffers
    DDP = nn.parallel.DistributedDataParallel
    no_sync_kw = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters else "broadcast_buffers"
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **{no_sync_kw: False})


def fsdp(model: nn.Module, compute_dtype: torch.dtype) -> nn.Module:
    """FSDP2 over the default process group: every block a unit, the root (embedding, head) the last.
    Returns the same module (its class becomes an FSDP subclass; its parameters, DTensor shards):
    build the optimizer afterwards."""
    return shard(model, list(model.blocks), compute_dtype)


def shard(root: nn.Module, units: list[nn.Module], compute_dtype: torch.dtype) -> nn.Module:
    """`fully_shard` on each unit (its weights gathered together, one unit at a time), then on the root
    (the weights left over), computing in `compute_dtype` from fp32 shards and reducing in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for unit in units:
        fully_shard(unit, mp_policy=policy)
    # the root's weights (a GPT's embedding and head) are needed first in backward: keep them gathered
    # after the forward instead of gathering them again at once
    fully_shard(root, mp_policy=policy, reshard_after_forward=False)
    return root


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0 (CPU; other ranks get {}): a collective every rank calls."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds (its storage: writing it writes the parameter)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_matrix(t: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded tensor (an all-gather across its mesh), or the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_rows(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The rows of `full` that this rank holds of `like`: all of them for a plain tensor; for a DTensor
    sharded on dim 0 (FSDP2's layout), torch.chunk's split (the last ranks may hold fewer rows, or none)."""
    if not isinstance(like, DTensor):
        return full
    if len(like.placements) != 1 or not like.placements[0].is_shard(0):
        raise ValueError(f"expected a tensor sharded on dim 0 (FSDP2), got placements {like.placements}")
    mesh = like.device_mesh
    chunks = torch.chunk(full, mesh.size(), dim=0)
    r = mesh.get_local_rank()
    part = chunks[r] if r < len(chunks) else full[:0]
    if part.shape != like.to_local().shape:
        raise ValueError(f"rows {tuple(part.shape)} of the full tensor do not match the local shard "
                         f"{tuple(like.to_local().shape)}")
    return part


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather(obj) -> list:
    """Every rank's `obj`, in rank order ([obj] without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj, src: int = 0):
    """Rank `src`'s `obj` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
