"""A standard LLaMA-3 decoder written for tracing on the meta device.

RMSNorm, rotary position embeddings (RoPE, theta 500000), grouped-query
attention through the fused SDPA op, SwiGLU feed-forward, untied input and
output embeddings. Shapes follow Meta's reference ``llama3/model.py``
(Touvron et al. 2023; Dubey et al. 2024, "The Llama 3 Herd of Models",
Table 3): ``hidden = multiple_of * ceil(ffn_dim_multiplier * (2/3 * 4 dim) /
multiple_of)``.

Mixed precision follows FSDP2's ``MixedPrecisionPolicy``: parameters are
stored in float32, cast to ``param_dtype`` for compute, and gradients are
cast to ``reduce_dtype`` before they are reduced (the casts are graph nodes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models.llama_config import ModelConfig, ffn_hidden_dim


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class CastLinear(nn.Module):
    """``y = x @ W.T`` with ``W`` stored in float32 and cast to the compute dtype.

    Shapes: x ``[..., in_features]`` -> y ``[..., out_features]``.
    """

    def __init__(self, in_features: int, out_features: int, compute_dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(self.compute_dtype))


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019) with a float32 weight."""

    def __init__(self, dim: int, eps: float, compute_dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(self.compute_dtype), self.eps)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[seq_len, head_dim // 2]`` of RoPE (Su et al. 2021, eq. 34)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x`` ``[B, H, T, hd]`` (interleaved real form of RoPE)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    """Grouped-query causal self-attention through the fused flash SDPA op."""

    def __init__(self, cfg: ModelConfig, dt: torch.dtype):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = CastLinear(cfg.dim, cfg.n_heads * self.head_dim, dt)
        self.wk = CastLinear(cfg.dim, cfg.n_kv_heads * self.head_dim, dt)
        self.wv = CastLinear(cfg.dim, cfg.n_kv_heads * self.head_dim, dt)
        self.wo = CastLinear(cfg.n_heads * self.head_dim, cfg.dim, dt)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin).to(x.dtype), apply_rope(k, cos, sin).to(x.dtype)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k = k[:, :, None].expand(b, self.n_kv_heads, rep, t, self.head_dim).reshape(
                b, self.n_heads, t, self.head_dim)
            v = v[:, :, None].expand(b, self.n_kv_heads, rep, t, self.head_dim).reshape(
                b, self.n_heads, t, self.head_dim)
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int, dt: torch.dtype):
        super().__init__()
        self.w1 = CastLinear(dim, hidden, dt)
        self.w2 = CastLinear(hidden, dim, dt)
        self.w3 = CastLinear(dim, hidden, dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, cfg: ModelConfig, hidden: int, dt: torch.dtype):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)
        self.attention = Attention(cfg, dt)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)
        self.feed_forward = FeedForward(cfg.dim, hidden, dt)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """LLaMA-3 decoder; ``forward(tokens [B, T] int64, labels [B, T]) -> loss []``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        dt = _dtype(cfg.param_dtype)
        self.compute_dtype = dt
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        overrides = {int(k): int(v) for k, v in dict(cfg.ffn_hidden_overrides or {}).items()}
        default_hidden = ffn_hidden_dim(cfg.dim, cfg.ffn_dim_multiplier, cfg.multiple_of)
        self.layers = nn.ModuleList(
            TransformerBlock(cfg, overrides.get(i, default_hidden), dt)
            for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)
        self.output = CastLinear(cfg.dim, cfg.vocab_size, dt)
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens).to(self.compute_dtype)
        cos, sin = self.freqs_cos, self.freqs_sin
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        return cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy ``[N, V], [N] -> []`` as ``log_softmax`` + ``nll_loss_forward``.

    ``F.cross_entropy`` decomposes to the same two ops (``log_softmax``, then
    ``aten::nll_loss`` -> ``nll_loss_forward``, whose derivative is ``nll_loss_backward``);
    calling ``nll_loss_forward`` directly keeps the graph independent of how
    ``aten::nll_loss`` dispatches on meta (in torch 2.13 it lost its backward there until
    the capture fixed that: :mod:`pipeline.stages.trace.composite`).
    """
    logp = torch.log_softmax(logits, dim=-1)
    return torch.ops.aten.nll_loss_forward(logp, labels, None, 1, -100)[0]


def build_model(cfg: Any) -> Transformer:
    """Build the model on the meta device (no memory, no weights)."""
    mc = cfg if isinstance(cfg, ModelConfig) else ModelConfig(**{
        k: cfg[k] for k in ModelConfig.__dataclass_fields__ if k in cfg})
    with torch.device("meta"):
        return Transformer(mc)


def example_inputs(cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Token batch and labels ``[batch_size, seq_len]`` int64 on meta."""
    shape = (int(cfg["batch_size"]), int(cfg["seq_len"]))
    return (torch.empty(shape, dtype=torch.int64, device="meta"),
            torch.empty(shape, dtype=torch.int64, device="meta"))


__all__ = ["Transformer", "build_model", "cross_entropy", "example_inputs", "rope_tables"]
