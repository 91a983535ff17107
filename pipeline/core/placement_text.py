"""The compact placement notation as text: its grammar, tokens and one-line errors (torch-free).

One token per mesh dim, concatenated without separators (whitespace is ignored):

======================  =====================================================
token                   DTensor placement (:mod:`pipeline.dtensor.placements`)
======================  =====================================================
``R``                   ``Replicate()``
``S(d)``                ``Shard(d)`` (``d`` may be negative, e.g. ``S(-1)``)
``SS(d,k)``             ``_StridedShard(d, split_factor=k)``, ``k >= 1``
``P``                   ``Partial("sum")`` (``P(sum)`` is accepted too)
``P(op)``               ``Partial(op)``, op in sum, avg, min, max, product,
                        band, bor, bxor (:data:`REDUCE_OPS`)
``MP(d)``               ``_MaskPartial(offset_dim=d)`` (no offset shape)
``MP(d,AxB..)``         ``_MaskPartial(offset_shape=(A, B, ..), offset_dim=d)``
``MP(op,d,AxB..)``      the same with a non-sum reduce op
``NP(p)``               ``_NormPartial(norm_type=p)`` (partial p-norm)
======================  =====================================================

A tuple output (an op returning several tensors) is written ``(A|B|...)``, one entry per
element, ``-`` (:data:`NON_TENSOR`) for a non-tensor element: ``(S(0)R|-|RR)``.

:func:`tokenize` and :func:`split_output` check the grammar and give :class:`Token`
records; :mod:`pipeline.dtensor.placements` turns them into DTensor placements, and the
config validation (:mod:`pipeline.config.validate`) checks constraint texts with them
without importing torch. Both are cached with :func:`functools.lru_cache`; the returned
tuples are immutable and shared.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = [
    "ALLOWED",
    "NON_TENSOR",
    "REDUCE_OPS",
    "Token",
    "split_output",
    "tokenize",
]

#: Reduce ops accepted in ``P(op)`` and ``MP(op,...)`` (those of
#: ``torch.distributed.ReduceOp`` that DTensor's ``Partial`` documents).
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "min", "max", "product", "band", "bor", "bxor")

#: Marker for a non-tensor element of a tuple output.
NON_TENSOR = "-"

#: What every parse error says is allowed.
ALLOWED = (
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


@dataclass(frozen=True)
class Token:
    """One token of the notation.

    Attributes:
        kind: ``R``, ``S``, ``SS``, ``P``, ``MP`` or ``NP``.
        dim: the tensor dim of ``S``/``SS``, the offset dim of ``MP``; else None.
        split: the split factor of ``SS``.
        op: the reduce op of ``P`` and ``MP`` (``sum`` when not written).
        offset_shape: the offset shape of ``MP`` (None when not written).
        norm: the norm of ``NP`` (an int when written as one, else a float).
    """

    kind: str
    dim: int | None = None
    split: int | None = None
    op: str | None = None
    offset_shape: tuple[int, ...] | None = None
    norm: int | float | None = None

    def is_shard(self) -> bool:
        """``S(d)``; as DTensor's ``Placement.is_shard()``, a strided shard is not one."""
        return self.kind == "S"

    def is_partial(self) -> bool:
        """``P``, ``MP`` and ``NP``: a pending reduction (DTensor's ``is_partial()``)."""
        return self.kind in ("P", "MP", "NP")

    def is_replicate(self) -> bool:
        return self.kind == "R"


def _reduce_op(text: str | None) -> str:
    op = text or "sum"
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}")
    return op


def _token(m: re.Match) -> Token:
    g = m.groupdict()
    if g["R"] is not None:
        return Token("R")
    if g["ss_dim"] is not None:
        k = int(g["ss_k"])
        if k < 1:
            raise ValueError(f"split factor must be >= 1, got {k}")
        return Token("SS", dim=int(g["ss_dim"]), split=k)
    if g["s_dim"] is not None:
        return Token("S", dim=int(g["s_dim"]))
    if g["mp_dim"] is not None:
        shape = g["mp_shape"]
        return Token("MP", dim=int(g["mp_dim"]), op=_reduce_op(g["mp_op"]),
                     offset_shape=tuple(int(s) for s in shape.split("x")) if shape else None)
    if g["np_p"] is not None:
        txt = g["np_p"]
        return Token("NP", norm=int(txt) if re.fullmatch(_INT, txt) else float(txt))
    return Token("P", op=_reduce_op(g["p_op"]))


@functools.lru_cache(maxsize=1 << 16)
def tokenize(text: str, ndim: int | None = None) -> tuple[Token, ...]:
    """The tokens of one placement, e.g. ``"S(0)R"`` -> ``(Token("S", dim=0), Token("R"))``.

    Args:
        text: tokens, one per mesh dim (whitespace ignored).
        ndim: if given, the number of mesh dims the text must describe.

    Raises:
        ValueError: one line naming the text and what is allowed, if the text is not a
            str, is empty, holds an unknown token or a bad split factor or reduce op, or
            has a token count != ``ndim``.
    """
    if not isinstance(text, str):
        raise ValueError(f"placement text must be a str, got {text!r}")  # noqa: TRY004
    s = _WS_RE.sub("", text)
    if not s:
        raise ValueError(f"invalid placement {text!r}: empty; {ALLOWED}")
    out: list[Token] = []
    pos = 0
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"invalid placement {text!r}: cannot parse at {s[pos:]!r}; {ALLOWED}")
        try:
            out.append(_token(m))
        except ValueError as e:
            raise ValueError(f"invalid placement {text!r}: {e}; {ALLOWED}") from None
        pos = m.end()
    if ndim is not None and len(out) != ndim:
        raise ValueError(
            f"invalid placement {text!r}: {len(out)} token(s) for a {ndim}-d mesh; "
            f"need exactly {ndim}, {ALLOWED}"
        )
    return tuple(out)


@functools.lru_cache(maxsize=1 << 14)
def _split_output(text: str, ndim: int | None) -> tuple[tuple[Token, ...] | None, ...]:
    s = _WS_RE.sub("", text)
    if not (s.startswith("(") and s.endswith(")")):
        return (tokenize(s, ndim),)
    inner = s[1:-1]
    if inner == "":
        return ()
    out: list[tuple[Token, ...] | None] = []
    for part in inner.split("|"):
        if part == NON_TENSOR:
            out.append(None)
            continue
        try:
            out.append(tokenize(part, ndim))
        except ValueError as e:
            raise ValueError(
                f"invalid output placement {text!r}: element {len(out)}: {e}") from None
    return tuple(out)


def split_output(text: str, ndim: int | None = None) -> tuple[tuple[Token, ...] | None, ...]:
    """The tokens of each element of a tuple output ``(A|B|-)`` (None for ``-``).

    A bare placement without parentheses (``S(0)R``) is a one-element output; ``()`` has
    no elements.

    Args:
        text: the notation, see the module docstring.
        ndim: if given, every tensor element must have exactly this many tokens.

    Raises:
        ValueError: one line naming the text, the element and what is allowed.
    """
    if not isinstance(text, str):
        raise ValueError(f"output placement text must be a str, got {text!r}")  # noqa: TRY004
    return _split_output(text, ndim)


def drop_first_token(text: str) -> str:
    """``text`` without its first token (the first mesh dim's placement):
    ``"S(0)RS(1)"`` -> ``"RS(1)"``.

    Raises:
        ValueError: the text does not start with a token or has only one.
    """
    s = _WS_RE.sub("", text)
    m = _TOKEN_RE.match(s)
    if m is None or m.end() == 0 or m.end() == len(s):
        raise ValueError(f"invalid placement {text!r}: need a token per mesh dim, the first "
                         "the pp dim's, and at least one more; " + ALLOWED)
    return s[m.end():]
