"""Optimizers: Muon for the transformer's 2-D weight matrices, AdamW for embeddings and the head.

Muon takes the momentum of a matrix's gradient and replaces it by the nearest semi-orthogonal matrix
(computed with a few Newton-Schulz iterations in bf16), so every direction of the update has the same
size. Embeddings and the output head are not ordinary matrix multiplies of hidden states, so they keep
AdamW. With DDP, gradients arrive all-reduced and every rank runs the same update.
"""
from __future__ import annotations

import torch
import torch.nn as nn

# quintic Newton-Schulz coefficients chosen to push singular values towards 1 fast (Keller Jordan)
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = NS_COEFFS
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
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


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p.grad)
                buf = state["momentum"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                g = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = orthogonalize(g, group["ns_steps"])
                # scale so the update's RMS does not depend on the matrix's aspect ratio
                scale = max(1.0, p.size(-2) / p.size(-1)) ** 0.5
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * scale)


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
        return CombinedOptimizer([adam, Muon(matrices, lr=matrix_lr, weight_decay=weight_decay)])
    adam_groups.append(dict(params=matrices, lr=matrix_lr * 0.1))
    return CombinedOptimizer([torch.optim.AdamW(adam_groups, betas=betas, eps=1e-10,
                                                weight_decay=weight_decay, **fused)])
