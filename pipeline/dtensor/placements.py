"""Compact text notation for DTensor placements: text <-> placement objects.

The notation (one token per mesh dim, ``S(0)RS(1)``; tuple outputs ``(A|B|-)``) and its
grammar are :mod:`pipeline.core.placement_text`, torch-free; this module turns its tokens
into DTensor placements (``R`` ``Replicate()``, ``S(d)`` ``Shard(d)``, ``SS(d,k)``
``_StridedShard(d, split_factor=k)``, ``P(op)`` ``Partial(op)``, ``MP(..)``
``_MaskPartial``, ``NP(p)`` ``_NormPartial``) and formats placements back.

Every placement DTensor (torch 2.13) can produce round-trips:
``parse_placements(format_placements(p)) == p``. The one caveat is
``_MaskPartial``, whose ``__eq__`` also compares the identity of its runtime mask
buffer; it round-trips in every field (reduce op, offset shape, offset dim) and
the text round-trips exactly, but a freshly parsed object is a new instance.

Parsing is cached with :func:`functools.lru_cache`, so hot loops may call
:func:`parse_placements` freely; the returned tuples are immutable and shared.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from pipeline.core.placement_text import ALLOWED as _ALLOWED
from pipeline.core.placement_text import NON_TENSOR, REDUCE_OPS, Token, split_output, tokenize
from pipeline.dtensor.torch_compat import (
    C_PARTIAL,
    C_REPLICATE,
    C_SHARD,
    C_STRIDED_SHARD,
    MaskPartial,
    NormPartial,
    StridedShard,
)

__all__ = [
    "NON_TENSOR",
    "REDUCE_OPS",
    "format_output",
    "format_placement",
    "format_placements",
    "format_strategy_output",
    "parse_output",
    "parse_placements",
]



# --------------------------------------------------------------------------- format


def _format_number(value: float) -> str:
    # ints print as ints, floats keep their repr ("2.0", "inf") so the type round-trips
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return repr(float(value))


def format_placement(p: Placement) -> str:
    """Format one placement as its token (``R``, ``S(0)``, ``P(max)``, ...).

    Raises:
        ValueError: for a placement type the notation does not know.
    """
    if NormPartial is not None and isinstance(p, NormPartial):
        return f"NP({_format_number(p.norm_type)})"
    if isinstance(p, MaskPartial):
        parts = [] if p.reduce_op == "sum" else [p.reduce_op]
        parts.append(str(int(p.offset_dim)))
        if p.offset_shape is not None:
            parts.append("x".join(str(int(s)) for s in p.offset_shape))
        return f"MP({','.join(parts)})"
    # The C++ base classes also cover raw torch._C._distributed placements.
    if isinstance(p, C_STRIDED_SHARD):
        return f"SS({int(p.dim)},{int(p.split_factor)})"
    if isinstance(p, C_SHARD):
        return f"S({int(p.dim)})"
    if isinstance(p, C_REPLICATE):
        return "R"
    if isinstance(p, C_PARTIAL):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    raise ValueError(f"cannot format placement {p!r}: {_ALLOWED}")


def format_placements(placements: Sequence[Placement]) -> str:
    """Format a per-mesh-dim placement tuple, e.g. ``(Shard(0), Replicate())`` -> ``"S(0)R"``.

    Args:
        placements: one DTensor placement per mesh dim (length >= 1).

    Raises:
        ValueError: if ``placements`` is empty or holds an unknown placement type.
    """
    if len(placements) == 0:
        raise ValueError("cannot format an empty placement tuple: one token per mesh dim needed")
    return "".join(format_placement(p) for p in placements)


def format_output(outputs: Sequence[Sequence[Placement] | None]) -> str:
    """Format the placements of a tuple output as ``(A|B|-)``.

    Args:
        outputs: one entry per tuple element: a placement tuple, or ``None`` for a
            non-tensor element (written ``-``).

    Returns:
        Always parenthesised, also for zero or one element: ``()``, ``(S(0)R)``.
    """
    return "(" + "|".join(NON_TENSOR if o is None else format_placements(o) for o in outputs) + ")"


def format_strategy_output(
    output: Sequence[Placement] | Sequence[Sequence[Placement] | None] | None,
) -> str:
    """Format a strategy's output: a placement tuple as ``S(0)R``; the per-element
    placements of a tuple-returning op as :func:`format_output` does (``(S(0)R|-)``);
    None (no tensor) as ``-``.

    Raises:
        ValueError: as :func:`format_placements`.
    """
    if output is None:
        return NON_TENSOR
    if len(output) and (output[0] is None or isinstance(output[0], (tuple, list))):
        return format_output(output)  # type: ignore[arg-type]
    return format_placements(output)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- parse


def _placement(tok: Token, text: str) -> Placement:
    """The DTensor placement of one token of ``text`` (:mod:`pipeline.core.placement_text`)."""
    if tok.kind == "R":
        return Replicate()
    if tok.kind == "SS":
        return StridedShard(tok.dim, split_factor=tok.split)
    if tok.kind == "S":
        return Shard(tok.dim)
    if tok.kind == "MP":
        shape = None if tok.offset_shape is None else torch.Size(tok.offset_shape)
        return MaskPartial(reduce_op=tok.op, offset_shape=shape, offset_dim=tok.dim)
    if tok.kind == "NP":
        if NormPartial is None:  # pragma: no cover
            raise ValueError(f"invalid placement {text!r}: _NormPartial is not available in "
                             f"this torch; {_ALLOWED}")
        return NormPartial(norm_type=tok.norm)
    return Partial(tok.op)


@functools.lru_cache(maxsize=1 << 16)
def parse_placements(text: str, ndim: int | None = None) -> tuple[Placement, ...]:
    """Parse compact notation into a placement tuple.

    Example: ``"S(0)R"`` -> ``(Shard(0), Replicate())``.

    Args:
        text: tokens, one per mesh dim (whitespace ignored).
        ndim: if given, the number of mesh dims the text must describe.

    Returns:
        A tuple of placements (cached and shared: do not rely on object identity
        across different texts).

    Raises:
        ValueError: one-line message naming the text and what is allowed, if the
            text is empty, holds an unknown token, or has a token count != ``ndim``
            (:func:`pipeline.core.placement_text.tokenize`).
    """
    return tuple(_placement(tok, text) for tok in tokenize(text, ndim))


@functools.lru_cache(maxsize=1 << 14)
def _parse_output_cached(text: str, ndim: int | None) -> tuple[tuple[Placement, ...] | None, ...]:
    return tuple(None if toks is None else tuple(_placement(tok, text) for tok in toks)
                 for toks in split_output(text, ndim))


def parse_output(text: str, ndim: int | None = None) -> list[tuple[Placement, ...] | None]:
    """Parse a tuple-output placement ``(A|B|-)`` into a list (``None`` for ``-``).

    A bare placement without parentheses (``S(0)R``) is accepted as a
    one-element output. ``()`` is the empty list.

    Args:
        text: the notation, see :mod:`pipeline.core.placement_text`.
        ndim: if given, every tensor element must have exactly this many tokens.

    Raises:
        ValueError: one-line message naming the text and what is allowed
            (:func:`pipeline.core.placement_text.split_output`).
    """
    if not isinstance(text, str):
        raise ValueError(f"output placement text must be a str, got {text!r}")  # noqa: TRY004
    return list(_parse_output_cached(text, ndim))


def local_shape(shape: Sequence[int], placements: Sequence[Placement],
                mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Per-device shape of a tensor: each sharded dim divided (ceil) by the sizes of
    the mesh dims sharding it (uneven sharding rounds up, as DTensor's largest shard)."""
    out = list(shape)
    for md, p in enumerate(placements):
        if p.is_shard():
            d = p.dim % len(out)
            out[d] = -(-out[d] // mesh_shape[md])
    return tuple(out)

