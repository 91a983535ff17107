"""The graph IR's JSON conventions, shared by every stage that reads ``graph.parquet``.

The trace stage (pipeline/stages/trace/stage.py) writes each node's ``args`` and ``kwargs`` as JSON.
A tensor argument is a *tensor reference* ``{"node": i}`` to the node producing it
(its graph index); a few values JSON cannot hold are tagged one-key objects:
``{"dtype": "bfloat16"}``, ``{"enum": "cpu"}`` (devices, layouts, memory formats),
``{"float": "inf"}`` (non-finite floats) and ``{"repr": ...}`` (anything else).

Tensor references are numbered in *flattened order*: a depth-first walk of ``args``
and then of ``kwargs``. Position ``k`` in that order is the node's tensor argument
``k``: its producer edge, its input metadata and its expected placement in a strategy
all use that index.

The ``target`` column names the op (``aten.mm.default``); :func:`resolve_op` turns it
back into the torch ``OpOverload``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "TENSOR_REF_RE",
    "decode_shared",
    "decode_value",
    "is_tensor_ref",
    "map_tensor_refs",
    "resolve_op",
    "tensor_refs",
    "with_shapes",
]

#: A tensor reference in the IR's JSON text (``json.dumps`` spacing).
TENSOR_REF_RE = re.compile(r'\{"node": \d+\}')


def is_tensor_ref(obj: Any) -> bool:
    """Whether a decoded IR value is a tensor reference ``{"node": i}``."""
    return isinstance(obj, dict) and set(obj) == {"node"}


def tensor_refs(obj: Any) -> list[int]:
    """The producer graph indices of the tensor references in ``obj``, flattened order."""
    if is_tensor_ref(obj):
        return [obj["node"]]
    if isinstance(obj, list):
        return [r for v in obj for r in tensor_refs(v)]
    if isinstance(obj, dict):
        return [r for v in obj.values() for r in tensor_refs(v)]
    return []


def map_tensor_refs(obj: Any, replace: Callable[[int], Any], start: int = 0) -> Any:
    """A copy of ``obj`` with tensor reference number ``k`` replaced by ``replace(k)``.

    References are numbered in flattened order from ``start`` (pass the number of
    references in ``args`` when mapping ``kwargs``); other values are kept as they are.
    """
    position = start

    def walk(x: Any) -> Any:
        nonlocal position
        if is_tensor_ref(x):
            position += 1
            return replace(position - 1)
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    return walk(obj)


def with_shapes(obj: Any, shapes: Sequence[Any], start: int = 0) -> Any:
    """Replace tensor references by ``shapes`` (flattened order from ``start``); a
    reference beyond the end of ``shapes`` becomes None."""
    return map_tensor_refs(obj, lambda k: shapes[k] if k < len(shapes) else None, start)


def decode_shared(texts: Sequence[str | None]) -> list[Any]:
    """``json.loads`` of each text (None stays None), each distinct text decoded once.

    Equal texts (the copies of a repeated layer) share one decoded object: read the
    results, never modify them.
    """
    memo: dict[str, Any] = {}
    out = []
    for text in texts:
        if text is None:
            out.append(None)
            continue
        hit = memo.get(text)
        if hit is None:
            hit = memo[text] = json.loads(text)
        out.append(hit)
    return out


def decode_value(obj: Any) -> Any:
    """A non-tensor IR argument back as the Python / torch value the op takes."""
    import torch

    if isinstance(obj, list):
        return [decode_value(v) for v in obj]
    if isinstance(obj, dict):
        if "dtype" in obj and len(obj) == 1:
            return getattr(torch, obj["dtype"])
        if "enum" in obj and len(obj) == 1:
            text = obj["enum"]
            if text.startswith("torch."):
                return getattr(torch, text.split(".", 1)[1])
            return torch.device(text)
        if "float" in obj and len(obj) == 1:
            return float(obj["float"])
        return {k: decode_value(v) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------- op names


@functools.lru_cache(maxsize=4096)
def _op_of_name(name: str) -> tuple[Any, str | None]:
    """``(op, None)`` for the op a name denotes, ``(None, why not)`` for none."""
    import torch

    parts = name.strip().removeprefix("torch.ops.").split(".")
    if len(parts) < 2:
        return None, "expected 'namespace.op[.overload]', e.g. 'aten.mm.default'"
    obj: Any = torch.ops
    try:
        for part in parts:
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        return None, "no such torch.ops entry (expected e.g. 'aten.mm.default')"
    if isinstance(obj, torch._ops.OpOverloadPacket):
        return _packet_representative(obj), None
    return obj, None


def _packet_representative(packet: Any) -> Any:
    """``packet.default`` if it returns a tensor, else the first overload that does.

    (``aten.mul.default`` is the scalar ``mul(Scalar, Scalar)``; ``aten.mul.Tensor`` is
    the tensor op a graph would hold.)
    """
    names = ["default", *[n for n in packet.overloads() if n != "default"]]
    for name in names:
        overload = getattr(packet, name, None)
        if overload is not None and any("Tensor" in str(r.type) for r in overload._schema.returns):
            return overload
    return getattr(packet, names[0])


def resolve_op(op: Any, strict: bool = True) -> Any:
    """Turn ``op`` into an ``OpOverload`` where possible.

    Accepts an ``OpOverload`` (returned as is), an ``OpOverloadPacket`` (its
    ``.default``, or its first tensor-returning overload), or a name such as the IR's
    ``"aten.mm.default"`` or ``"torch.ops.aten.mm"``. Anything else
    (``operator.getitem``, a higher-order op, ...) is returned unchanged.

    Raises:
        ValueError: for a name that names no op, unless ``strict`` is False: then
            the result is None (the topology stage gives such a node the
            replicate-only fallback strategy).
    """
    import torch

    if isinstance(op, str):
        found, why_not = _op_of_name(op)
        if why_not is None:
            return found
        if not strict:
            return None
        raise ValueError(f"cannot resolve op {op!r}: {why_not}")
    if isinstance(op, torch._ops.OpOverloadPacket):
        return _packet_representative(op)
    return op
