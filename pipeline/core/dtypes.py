"""Bytes per element of the dtype names the graph IR carries (``"bfloat16"`` -> 2), torch-free.

The table is ``torch.dtype.itemsize`` of every attribute of the ``torch`` module that is
a ``torch.dtype`` in PyTorch 2.13 (the version ``pyproject.toml`` pins; c10's
``elementSize`` of ``c10/core/ScalarType.h``), aliases included (``float``, ``half``,
``long`` ...), so :func:`itemsize` answers what ``getattr(torch, name).itemsize`` does
without importing torch. Sub-byte and bit-packed dtypes (``int4``, ``uint1`` / ``bit``,
``bits1x8``, ``float4_e2m1fn_x2``) report 1 there, and do here. ``tests/test_dtypes.py``
checks the table against the installed torch, both ways.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["ITEMSIZE", "itemsize", "numel"]

#: dtype name (a ``torch`` attribute) -> bytes per element (``torch.dtype.itemsize``).
ITEMSIZE: dict[str, int] = {
    **dict.fromkeys((
        "bool", "int8", "uint8", "qint8", "quint8", "quint2x4", "quint4x2",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
        "float8_e8m0fnu", "float4_e2m1fn_x2", "bits1x8", "bits2x4", "bits4x2", "bits8",
        "bit", "int1", "int2", "int3", "int4", "int5", "int6", "int7",
        "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7"), 1),
    **dict.fromkeys(("bfloat16", "float16", "half", "int16", "short", "uint16", "bits16"), 2),
    **dict.fromkeys(("float32", "float", "int32", "int", "uint32", "qint32", "complex32",
                     "chalf"), 4),
    **dict.fromkeys(("float64", "double", "int64", "long", "uint64", "complex64", "cfloat"),
                    8),
    **dict.fromkeys(("complex128", "cdouble"), 16),
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (``bfloat16`` -> 2), as ``torch.dtype.itemsize``.

    Raises ValueError for a name that is not a torch dtype.
    """
    size = ITEMSIZE.get(dtype)
    if size is None:
        raise ValueError(f"unknown dtype {dtype!r}")
    return size


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape`` (1 for a scalar, ``()``)."""
    return math.prod(shape) if shape else 1
