"""A small language model of your own, planned by the pipeline without touching its code.

docs/models.md, "Your own module": from this directory,

    python -m pipeline model=custom model.builder._target_=custom_model.TinyLM \
        model.builder.layers=2 "model.inputs=[{name:tokens,shape:[16,256],dtype:int64,high:1000}]" \
        mesh=2x4

builds ``TinyLM(layers=2)`` on the meta device, feeds it a ``[16, 256]`` token batch and
plans the training step with the default loss (cross-entropy of the logits against an
added ``labels`` input).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-norm residual MLP block: ``x + down(gelu(up(norm(x))))``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """``tokens [B, T] int64 -> logits [B, T, vocab]``; the output head shares the
    embedding's weight (tied: one parameter tensor, one placement, one gradient)."""

    def __init__(self, vocab: int = 1000, dim: int = 128, layers: int = 2, hidden: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def torch_cross_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy`` as a ``model.loss`` target
    (``model.loss={_target_:custom_model.torch_cross_entropy}``): the cross-entropy of
    the logits against the input tokens themselves (a toy target), traced with its
    backward like any loss made of torch's own ops."""
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
