"""Optimizers: Muon for the transformer's 2-D weight matrices, AdamW for embeddings and the head.

Muon takes the momentum of a matrix's gradient and replaces it by the nearest semi-orthogonal matrix
(computed with a few Newton-Schulz iterations in bf16), so every direction of the update has the same
size. Embeddings and the output head are not ordinary matrix multiplies of hidden states, so they keep
AdamW. With DDP, gradients arrive all-reduced and every rank runs the same update.

Under FSDP each rank holds only some rows of each matrix (and of its gradient and momentum), but the
orthogonalisation is a function of the whole matrix. Muon here takes the full matrix: each step it
all-gathers every matrix's Nesterov momentum (in the Newton-Schulz dtype, bf16 on a GPU: half the bytes
of one fp32 all-gather of the weights), orthogonalises the whole matrices as one rank would, and keeps
the rows of the update its own shard holds. Every rank does the whole Newton-Schulz, as every DDP rank
does now, so the update is the single-process update exactly, with no approximation; the cost over DDP
is that all-gather. A sharded orthogonalisation (each rank orthogonalising a share of the matrices and
scattering the results) would divide the compute by the rank count for a second collective; at these
model sizes the Newton-Schulz is a few percent of a step (bench/train_step.py), so the simple form wins.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .parallel import full_matrix, local, local_rows

# quintic Newton-Schulz coefficients chosen to push singular values towards 1 fast (Keller Jordan)
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def ns_dtype(g: torch.Tensor) -> torch.dtype:
    """The dtype Newton-Schulz runs in: bf16 on a GPU (its tensor cores), fp32 elsewhere."""
    return torch.bfloat16 if g.is_cuda else torch.float32


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Nearest semi-orthogonal matrix to g (or to each matrix of a stack g[..., r, c])."""
    a, b, c = NS_COEFFS
    x = g.to(ns_dtype(g))
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    if transposed:
        x = x.mT
    return x.to(g.dtype)


_compiled_orthogonalize = None


def _orthogonalize_fn(device: torch.device):
    """On CUDA the Newton-Schulz loop is compiled once (its elementwise steps fuse); CPU runs it eagerly."""
    global _compiled_orthogonalize
    if device.type != "cuda":
        return orthogonalize
    if _compiled_orthogonalize is None:
        _compiled_orthogonalize = torch.compile(orthogonalize, dynamic=False)
    return _compiled_orthogonalize


class Muon(torch.optim.Optimizer):
    """Muon over groups of same-shape matrices: momentum with foreach ops, then one batched
    Newton-Schulz per shape (a d20 GPT has 100 matrices but only 3 shapes, so 3 stacks of large
    batched matmuls instead of 100 x 15 small ones). The update is the same as one matrix at a time.

    `splits` maps a parameter to row counts when it holds several matrices stacked by rows (the fused
    q/k/v projection): each part is orthogonalised on its own, exactly as if they were separate.
    Parameters sharded by FSDP (DTensors) are updated through their whole matrices (module docstring)."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
                 splits: dict | None = None):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay))
        self.splits = {id(p): list(rows) for p, rows in (splits or {}).items()}

    @torch.no_grad()
    def step(self, closure=None):  # closure: the Optimizer signature (torch.distributed's state-dict helpers call it)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p.grad)
                bufs.append(state["momentum"])
            torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
            if group["nesterov"]:
                # in place on the gradients (not read again before zero_grad): torch 2.11's DTensor has a
                # sharding rule for the in-place foreach lerp only, and FSDP's gradients are DTensors
                torch._foreach_lerp_(grads, bufs, group["momentum"])
            sources = grads if group["nesterov"] else bufs
            # whole matrices (gathered when FSDP shards them), cut into their parts, grouped by shape
            by_shape: dict[tuple, list] = {}
            pieces: list[list] = []
            for i, (p, g) in enumerate(zip(params, sources)):
                full = full_matrix(g.to(ns_dtype(g)))
                pieces.append(list(full.split(self.splits[id(p)])) if id(p) in self.splits else [full])
                for j, piece in enumerate(pieces[i]):
                    by_shape.setdefault(tuple(piece.shape), []).append((i, j))
            for shape, where in by_shape.items():
                update = _orthogonalize_fn(params[0].device)(torch.stack([pieces[i][j] for i, j in where]),
                                                              group["ns_steps"])
                # scale so the update's RMS does not depend on the matrix's aspect ratio
                scale = max(1.0, shape[-2] / shape[-1]) ** 0.5
                for (i, j), u in zip(where, update.unbind(0)):
                    u = u.to(params[i].dtype)  # scaled in the weights' dtype, not in bf16
                    pieces[i][j] = u if scale == 1.0 else u * scale
            targets = [local(p) for p in params]  # this rank's rows of each parameter
            if group["weight_decay"]:
                torch._foreach_mul_(targets, 1 - group["lr"] * group["weight_decay"])
            updates = [local_rows(torch.cat(parts) if len(parts) > 1 else parts[0], p) for p, parts in zip(params, pieces)]
            torch._foreach_add_(targets, updates, alpha=-group["lr"])


class CombinedOptimizer:
    """Several optimizers stepped together, with one state_dict (for checkpoints) and one lr schedule:
    each param group keeps its base lr in `initial_lr` and `set_lr_multiplier` scales them all."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        for opt in optimizers:
            for g in opt.param_groups:
                g.setdefault("initial_lr", g["lr"])

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def set_lr_multiplier(self, m: float):
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = g["initial_lr"] * m

    def state_dict(self):
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, states):
        for opt, s in zip(self.optimizers, states):
            opt.load_state_dict(s)


def build_optimizer(model: nn.Module, matrix_lr: float, embedding_lr: float, head_lr: float,
                    weight_decay: float = 0.0, betas=(0.8, 0.95), use_muon: bool = True) -> CombinedOptimizer:
    """Matrix params of the blocks -> Muon (or AdamW if use_muon is off); embedding, head -> AdamW.
    AdamW lrs are scaled by 1/sqrt(width/768) so a wider model takes smaller steps (as nanochat does)."""
    width = model.config.n_embd
    scale = (width / 768) ** -0.5
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    others = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim != 2]
    adam_groups = [
        dict(params=list(model.wte.parameters()), lr=embedding_lr * scale),
        dict(params=list(model.lm_head.parameters()), lr=head_lr * scale),
    ]
    if others:
        adam_groups.append(dict(params=others, lr=embedding_lr * scale))
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    if use_muon:
        adam = torch.optim.AdamW(adam_groups, betas=betas, eps=1e-10, weight_decay=0.0, **fused)
        splits = {p: model.config.qkv_rows for n, p in model.named_parameters() if n.endswith("attn.c_qkv.weight")}
        return CombinedOptimizer([adam, Muon(matrices, lr=matrix_lr, weight_decay=weight_decay, splits=splits)])
    adam_groups.append(dict(params=matrices, lr=matrix_lr * 0.1))
    return CombinedOptimizer([torch.optim.AdamW(adam_groups, betas=betas, eps=1e-10,
                                                weight_decay=weight_decay, **fused)])
