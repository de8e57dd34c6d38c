"""The GPT decoder: RoPE, RMSNorm, QK-norm, grouped-query attention, relu^2 MLP, untied head.

Knows nothing of data, DVC, HTTP or precision backends: a backend swaps `nn.Linear` modules after the
model is built (see model/precision), so there are no precision branches here.

The forward pass has two modes:
- training / scoring: `model(idx, targets)` with plain causal attention (fast SDPA path);
- generation: `model(idx, kv_cache=cache)` where `cache` is a `KVCache` whose rows may hold sequences
  of different lengths (continuous batching); new tokens are written at each row's own position.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention


@dataclass
class GPTConfig:
    vocab_size: int = 4096
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_kv_head: int = 2
    seq_len: int = 256  # longest context the model is trained for (RoPE table is longer)
    rope_base: float = 10000.0
    logit_softcap: float = 15.0  # tanh cap on logits, stabilises small models

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError("head dimension must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def qkv_rows(self) -> list[int]:
        """Output rows of the fused q/k/v projection, in that order."""
        return [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim]

    def to_dict(self) -> dict:
        return asdict(self)


def norm(x: torch.Tensor) -> torch.Tensor:
    # parameter-free RMSNorm: fewer parameters and no precision question about norm weights
    return F.rms_norm(x, (x.size(-1),))


ROW_PRODUCTS = False
"""Under torch.compile, a Linear applied to a single row (a decode step at one stream) is written as a
product and a sum, which Inductor makes one reduction kernel with the neighbouring elementwise work (the
squared ReLU, a residual add) fused in, instead of a cuBLAS GEMV with kernels of their own around it. A
process-wide switch the engine's graphs set (model/decode_graphs.py); off, every Linear is called as is."""


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x), or, with ROW_PRODUCTS and one row, the same product as a sum in fp32 (see ROW_PRODUCTS)."""
    if ROW_PRODUCTS and type(linear) is nn.Linear and x.numel() == x.shape[-1]:
        return (x.float().unsqueeze(-2) * linear.weight.float()).sum(-1).to(x.dtype)
    return linear(x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, T, H, D); cos/sin: (B or 1, T, 1, D/2)
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1).type_as(x)


class KVCache:
    """Keys and values for up to `batch` sequences of up to `max_len` tokens.

    Rows are independent sequences; `lengths[b]` counts the tokens row b holds. `view(start, stop)`
    gives a cache over a contiguous range of rows that shares storage (no copy), which is how an
    engine prefills one new request while others keep their rows.

    `flex`: read with FlexAttention over the 128-slot blocks each row has filled (`cache_block_mask`)
    instead of SDPA with a boolean mask over every slot. Only for callers that compile the blocks:
    uncompiled, FlexAttention runs its reference implementation, which is slow, materialises every
    score, ignores which blocks a row visits and cannot run inside a CUDA graph capture. Why the
    engine's graphs use it: model/decode_graphs.py's DecodeGraphs.
    """

    def __init__(self, config: GPTConfig, batch: int, max_len: int, device, dtype, flex: bool = False):
        shape = (batch, config.n_kv_head, max_len, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len
        self.flex = flex

    @classmethod
    def _from_parts(cls, k, v, lengths, max_len, flex):
        c = cls.__new__(cls)
        c.k, c.v, c.lengths, c.max_len, c.flex = k, v, lengths, max_len, flex
        return c

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def view(self, start: int, stop: int) -> "KVCache":
        return KVCache._from_parts([k[start:stop] for k in self.k], [v[start:stop] for v in self.v],
                                   self.lengths[start:stop], self.max_len, self.flex)

    def copy_rows(self, src: "list[int] | torch.Tensor", dst: "list[int] | torch.Tensor", n: int) -> None:
        """Copy rows src into rows dst (none of them a source), their first n slots, in one copy a layer:
        copied a row at a time (two kernels a row and layer), 120 rows of the d20 cache cost the engine
        about a sixth of its tokens at 128 streams on an H100 (bench/results/serving.md, "The shared
        prefill's copies")."""
        s, d = torch.as_tensor(src, device=self.lengths.device), torch.as_tensor(dst, device=self.lengths.device)
        for k, v in zip(self.k, self.v):
            k[d, :, :n] = k[s, :, :n]
            v[d, :, :n] = v[s, :, :n]
        self.lengths[d] = self.lengths[s]


QUERY_SPAN = 1 << 16  # the query block of `cache_block_mask`: longer than any chunk a cache takes at once
# FlexAttention's kernel for one new token a row: query tiles of 16 rows (its default tiles 128 when the
# batch size is not fixed at compile time, as in the engine's graphs) read 64 slots at a time
# (bench/results/serving.md, "The cache read by FlexAttention")
FLEX_DECODE_OPTIONS = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def cache_block_mask(positions: torch.Tensor, kv_len: int) -> BlockMask:
    """The FlexAttention form of the cache mask: new token (b, t) at position positions[b, t] sees slots
    0..positions[b, t]. Each row visits only the 128-slot blocks up to its last position, so a decode
    step reads each row's filled part of the cache, not every slot of the bucket. Built from the block
    counts directly (no `create_block_mask` pass over every slot) and with no host read, so a CUDA graph
    can hold it.

    Shaped so the compiled blocks see few distinct shapes (each is a compile of its own, and torch.compile
    compiles a dimension of size 1 apart from the others): one query block spans every new token, and
    the list of slot blocks is at least two wide (a row never visits more than it has filled)."""
    B, T = positions.shape
    if T > QUERY_SPAN:
        raise ValueError(f"{T} new tokens at once: a FlexAttention cache takes at most {QUERY_SPAN}")
    size = 128
    blocks = -(-kv_len // size)
    width = max(2, blocks)
    # one bound for all of a row's queries; never past kv_len (as SDPA's mask: slots past it unseen)
    visited = (positions[:, -1] // size + 1).clamp(max=blocks).to(torch.int32)
    indices = torch.arange(width, device=positions.device, dtype=torch.int32)
    indices = indices.view(1, 1, 1, width).expand(B, 1, 1, width).contiguous()

    def sees(b, h, q, kv):
        return kv <= positions[b, q]

    return BlockMask.from_kv_blocks(visited.view(B, 1, 1), indices, BLOCK_SIZE=(QUERY_SPAN, size), mask_mod=sees,
                                    seq_lengths=(T, kv_len), compute_q_blocks=False)  # q blocks: backward only


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        # q, k and v in one projection: one larger GEMM (and one FP8 cast of x) instead of three
        self.c_qkv = nn.Linear(config.n_embd, sum(config.qkv_rows), bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.qkv_rows = config.qkv_rows

    def forward(self, x, cos, sin, cache: tuple | None, positions, mask=None):
        B, T, _ = x.shape
        q, k, v = project(self.c_qkv, x).split(self.qkv_rows, dim=-1)
        # RoPE and QK-norm in (B, T, H, D), the projection's own layout; only the attention kernel sees (B, H, T, D).
        # Backward then writes the fused q/k/v gradient with one cheaper copy (a shorter bf16 micro-step
        # than heads-first: bench/results/precision.md, "Attention layout")
        q = q.reshape(B, T, self.n_head, self.head_dim)
        k = k.reshape(B, T, self.n_kv_head, self.head_dim)
        v = v.reshape(B, T, self.n_kv_head, self.head_dim)
        q, k = norm(apply_rope(q, cos, sin)), norm(apply_rope(k, cos, sin))  # QK-norm
        gqa = {"enable_gqa": True} if self.n_kv_head != self.n_head else {}
        if cache is None:
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, **gqa)
        else:
            kc, vc = cache
            rows = torch.arange(B, device=x.device)[:, None]
            # advanced indices around a slice put (B, T) first: assign (B, T, H, D)
            kc[rows, :, positions] = k.to(kc.dtype)
            vc[rows, :, positions] = v.to(vc.dtype)
            # attend over the mask's slots only (the caller's bound on every row's length)
            flex = isinstance(mask, BlockMask)
            kv_len = mask.seq_lengths[1] if flex else mask.shape[-1]
            keys, values = kc[:, :, :kv_len].to(q.dtype), vc[:, :, :kv_len].to(q.dtype)
            if flex:
                opts = FLEX_DECODE_OPTIONS if T == 1 else None
                y = flex_attention(q.transpose(1, 2), keys, values, block_mask=mask, kernel_options=opts, **gqa)
            else:
                y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, **gqa)
        return project(self.c_proj, y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    activation = "relu2"  # declared, so a precision backend that fuses the activation can check it

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return project(self.c_proj, F.relu(project(self.c_fc, x)).square())


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attn = Attention(config)
        self.mlp = MLP(config)

    def forward(self, x, xn, cos, sin, cache: tuple | None = None, positions=None, mask=None):
        """x: the residual stream, xn: norm(x); returns the same pair for the next block. The norm is taken
        where x is made, so a block compiled on its own (the engine, TE) fuses it with its last residual
        add instead of starting the next block with a kernel of its own. cache: this layer's (keys,
        values) during generation, written at `positions`, read where `mask` (B, 1, T, slots), or its
        BlockMask form for a FlexAttention cache, is true;
        no layer index, so torch.compile sees every block as the same code (one compile, not one per
        layer)."""
        x = x + self.attn(xn, cos, sin, cache, positions, mask)
        x = x + self.mlp(norm(x))
        return x, norm(x)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # RoPE tables 4x the training context, so generation can run a little past it
        self.rope_len = config.seq_len * 4
        cos, sin = self._rope_tables(self.rope_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _rope_tables(self, n: int):
        d = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
        return freqs.cos(), freqs.sin()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Deterministic init: uniform with std 1/sqrt(fan_in) for inputs, zero output projections."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        d = self.config.n_embd
        self.wte.weight.copy_(torch.randn(self.wte.weight.shape, generator=g))
        self.lm_head.weight.copy_(torch.randn(self.lm_head.weight.shape, generator=g) * 0.001)
        bound = math.sqrt(3.0) / math.sqrt(d)
        for block in self.blocks:
            for lin in (block.attn.c_qkv, block.mlp.c_fc):
                lin.weight.copy_(torch.rand(lin.weight.shape, generator=g) * 2 * bound - bound)
            # zero-init residual outputs: each block starts as the identity
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward), counted from the shape alone.

        6 x matmul parameters (embedding lookup excluded) + 12 x layers x width x context for attention
        scores; it never looks at module types, so it stays the same whatever backend swapped the Linears.
        """
        c = self.config
        per_layer = c.n_embd * (c.n_head + 2 * c.n_kv_head) * c.head_dim + c.n_embd ** 2 + 8 * c.n_embd ** 2
        matmul_params = c.n_layer * per_layer + c.n_embd * c.vocab_size
        return 6 * matmul_params + 12 * c.n_layer * c.n_embd * c.seq_len

    def forward(self, idx, targets=None, kv_cache: KVCache | None = None,
                reduction: str = "mean", kv_len: int | None = None):
        """Logits (B, T, V), or the loss with `targets` (`reduction` "kept": the -log p of each target that is
        not -1, in order, the head run at those positions only; it has data-dependent shapes, so it is
        for uncompiled use). With `kv_cache`, the new tokens go after each
        row's cached ones; `kv_len`, when the caller knows it, bounds every row's length after this
        call (it keeps the call free of host synchronisation, so it can be captured in a CUDA graph)."""
        x, xn, cos, sin, positions, mask = self.inputs(idx, kv_cache, kv_len)
        for i, block in enumerate(self.blocks):
            x, xn = block(x, xn, cos, sin, None if kv_cache is None else (kv_cache.k[i], kv_cache.v[i]),
                          positions, mask)
        if kv_cache is not None:
            kv_cache.lengths += idx.shape[1]
        return self.head(xn, targets, reduction)

    def inputs(self, idx, kv_cache: KVCache | None = None, kv_len: int | None = None):
        """What every block takes: the embedded stream and its norm, the RoPE tables at each token's
        position and, with a cache, the positions and the mask of the slots each token sees. A method of
        its own, as `head` is; the engine leaves it uncompiled (compiled, it saved nothing in a decode
        step: bench/results/serving.md, "The cache read by FlexAttention")."""
        T = idx.shape[1]
        if kv_cache is None:
            if T > self.rope_len:
                raise ValueError(f"sequence of {T} tokens exceeds the model's RoPE table ({self.rope_len})")
            cos, sin = self.cos[None, :T, None], self.sin[None, :T, None]
            positions = mask = None
        else:
            positions = kv_cache.lengths[:, None] + torch.arange(T, device=idx.device)[None, :]
            if kv_len is None:
                kv_len = int(positions.max()) + 1
            if kv_len > min(kv_cache.max_len, self.rope_len):
                raise ValueError("sequence is longer than the KV cache / context")
            cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
            # the slots each new token sees: its row's filled ones and itself. The same for every layer,
            # so made once here rather than by a kernel in each block
            if kv_cache.flex:
                mask = cache_block_mask(positions, kv_len)
            else:
                mask = (torch.arange(kv_len, device=idx.device)[None, None, :] <= positions[:, :, None])[:, None]
        x = norm(self.wte(idx))
        return x, norm(x), cos, sin, positions, mask

    def head(self, xn, targets=None, reduction: str = "mean"):
        """Output head on the last block's normed stream, logit cap and (with targets) the loss. A method
        of its own so a backend that compiles block by block can compile this part too."""
        if reduction == "kept":  # -log p of each kept target only: the head runs at those positions alone
            keep = targets.reshape(-1) != -1  # (an RL step scores a few reply ids after a long prompt)
            xn, targets = xn.reshape(-1, xn.size(-1))[keep], targets.reshape(-1)[keep]
            reduction = "none"
        logits = project(self.lm_head, xn).float()
        cap = self.config.logit_softcap
        logits = cap * torch.tanh(logits / cap)
        if targets is None:
            return logits
        # targets of -1 are ignored (padding, prompt tokens in SFT); the mean is over the rest
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1,
                               reduction=reduction)
