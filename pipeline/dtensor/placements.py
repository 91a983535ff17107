"""Compact text notation for DTensor placements.

One token per mesh dim, concatenated without separators (whitespace is ignored):

======================  =====================================================
token                   placement
======================  =====================================================
``R``                   ``Replicate()``
``S(d)``                ``Shard(d)`` (``d`` may be negative, e.g. ``S(-1)``)
``SS(d,k)``             ``_StridedShard(d, split_factor=k)``
``P``                   ``Partial("sum")`` (``P(sum)`` is accepted too)
``P(op)``               ``Partial(op)``, op in sum, avg, min, max, product,
                        band, bor, bxor
``MP(d)``               ``_MaskPartial(offset_dim=d)`` (no offset shape)
``MP(d,AxB..)``         ``_MaskPartial(offset_shape=(A, B, ..), offset_dim=d)``
                        (row-wise embedding / gather strategies)
``MP(op,d,AxB..)``      the same with a non-sum reduce op
``NP(p)``               ``_NormPartial(norm_type=p)`` (partial p-norm)
======================  =====================================================

Examples: ``S(0)RS(1)`` on a 3-d mesh, ``PR``, ``SS(0,4)S(0)``.

A tuple output (an op returning several tensors) is written ``(A|B|...)``, one
entry per element, ``-`` for a non-tensor element: ``(S(0)R|-|RR)``.

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
import re
from collections.abc import Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

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

#: Reduce ops accepted in ``P(op)`` (those of ``torch.distributed.ReduceOp`` that
#: DTensor's ``Partial`` documents).
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "min", "max", "product", "band", "bor", "bxor")


#: Marker for a non-tensor element of a tuple output.
NON_TENSOR = "-"

_ALLOWED = (
    "allowed tokens, one per mesh dim: R, S(d), SS(d,k), P, P(op) with op in "
    + "|".join(REDUCE_OPS)
    + ", MP(d), MP(d,AxB..), MP(op,d,AxB..), NP(p)"
)

_INT = r"-?\d+"
_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|inf)"
_TOKEN_RE = re.compile(
    r"(?P<R>R)"
    rf"|SS\((?P<ss_dim>{_INT}),(?P<ss_k>\d+)\)"
    rf"|S\((?P<s_dim>{_INT})\)"
    rf"|MP\((?:(?P<mp_op>[a-z_]+),)?(?P<mp_dim>{_INT})(?:,(?P<mp_shape>\d+(?:x\d+)*))?\)"
    rf"|NP\((?P<np_p>{_NUM})\)"
    r"|P(?:\((?P<p_op>[a-z_]+)\))?"
)
_WS_RE = re.compile(r"\s+")


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


def _token_to_placement(m: re.Match) -> Placement:
    g = m.groupdict()
    if g["R"] is not None:
        return Replicate()
    if g["ss_dim"] is not None:
        k = int(g["ss_k"])
        if k < 1:
            raise ValueError(f"split factor must be >= 1, got {k}")
        return StridedShard(int(g["ss_dim"]), split_factor=k)
    if g["s_dim"] is not None:
        return Shard(int(g["s_dim"]))
    if g["mp_dim"] is not None:
        op = g["mp_op"] or "sum"
        if op not in REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}")
        shape_txt = g["mp_shape"]
        shape = torch.Size(int(s) for s in shape_txt.split("x")) if shape_txt else None
        return MaskPartial(reduce_op=op, offset_shape=shape, offset_dim=int(g["mp_dim"]))
    if g["np_p"] is not None:
        if NormPartial is None:  # pragma: no cover
            raise ValueError("_NormPartial is not available in this torch")
        txt = g["np_p"]
        value: float | int = int(txt) if re.fullmatch(_INT, txt) else float(txt)
        return NormPartial(norm_type=value)
    op = g["p_op"] or "sum"
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}")
    return Partial(op)


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
            text is empty, holds an unknown token, or has a token count != ``ndim``.
    """
    if not isinstance(text, str):
        raise ValueError(f"placement text must be a str, got {text!r}")  # noqa: TRY004
    s = _WS_RE.sub("", text)
    if not s:
        raise ValueError(f"invalid placement {text!r}: empty; {_ALLOWED}")
    out: list[Placement] = []
    pos = 0
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"invalid placement {text!r}: cannot parse at {s[pos:]!r}; {_ALLOWED}")
        try:
            out.append(_token_to_placement(m))
        except ValueError as e:
            raise ValueError(f"invalid placement {text!r}: {e}; {_ALLOWED}") from None
        pos = m.end()
    if ndim is not None and len(out) != ndim:
        raise ValueError(
            f"invalid placement {text!r}: {len(out)} token(s) for a {ndim}-d mesh; "
            f"need exactly {ndim}, {_ALLOWED}"
        )
    return tuple(out)


@functools.lru_cache(maxsize=1 << 14)
def _parse_output_cached(text: str, ndim: int | None) -> tuple[tuple[Placement, ...] | None, ...]:
    s = _WS_RE.sub("", text)
    if not (s.startswith("(") and s.endswith(")")):
        return (parse_placements(s, ndim),)
    inner = s[1:-1]
    if inner == "":
        return ()
    out: list[tuple[Placement, ...] | None] = []
    for part in inner.split("|"):
        if part == NON_TENSOR:
            out.append(None)
            continue
        try:
            out.append(parse_placements(part, ndim))
        except ValueError as e:
            raise ValueError(
                f"invalid output placement {text!r}: element {len(out)}: {e}"
            ) from None
    return tuple(out)


def parse_output(text: str, ndim: int | None = None) -> list[tuple[Placement, ...] | None]:
    """Parse a tuple-output placement ``(A|B|-)`` into a list (``None`` for ``-``).

    A bare placement without parentheses (``S(0)R``) is accepted as a
    one-element output. ``()`` is the empty list.

    Args:
        text: the notation, see module docstring.
        ndim: if given, every tensor element must have exactly this many tokens.

    Raises:
        ValueError: one-line message naming the text and what is allowed.
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

