"""Strategy lists on their way back from a worker process (pipeline/core/parallel.py).

A worker of :meth:`~pipeline.stages.topology.strategies.StrategyEnumerator.prefetch`
sends its strategy lists back pickled. Pickling DTensor's ``_MaskPartial`` keeps neither
its mask buffer nor its offset (its C++ base class pickles only the reduce op), so
:func:`portable` turns each into a :class:`PortableMask` (its fields, the buffer as a
number shared by the placements that shared one) and :func:`restored` turns them back,
one new mask buffer per number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.stages.topology.candidates import StrategyList

__all__ = ["PortableMask", "portable", "restored"]


@dataclass(frozen=True)
class PortableMask:
    """A ``_MaskPartial`` as its fields; ``buffer`` numbers its mask buffer."""

    reduce_op: str
    offset_shape: tuple[int, ...] | None
    offset_dim: int
    buffer: int


def _map_leaves(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` (a StrategyList, nested tuples / lists of placements) with ``leaf`` applied
    to every element that is none of those."""
    if isinstance(obj, StrategyList):
        return StrategyList(_map_leaves(obj.outputs, leaf), _map_leaves(obj.inputs, leaf),
                            obj.fallback)
    if isinstance(obj, tuple):
        return tuple(_map_leaves(x, leaf) for x in obj)
    if isinstance(obj, list):
        return [_map_leaves(x, leaf) for x in obj]
    return leaf(obj)


def portable(obj: Any, buffers: dict[int, int]) -> Any:
    """``obj`` (a StrategyList, tuples, placements) with every ``_MaskPartial`` as a
    :class:`PortableMask` (``buffers``: ``id`` of a mask buffer -> its number)."""
    from pipeline.dtensor.torch_compat import MaskPartial

    def leaf(p: Any) -> Any:
        if not isinstance(p, MaskPartial):
            return p
        shape = None if p.offset_shape is None else tuple(int(s) for s in p.offset_shape)
        number = buffers.setdefault(id(p.mask_buffer), len(buffers))
        return PortableMask(p.reduce_op, shape, int(p.offset_dim), number)

    return _map_leaves(obj, leaf)


def restored(obj: Any, buffers: dict[int, Any]) -> Any:
    """The inverse of :func:`portable`: each :class:`PortableMask` a ``_MaskPartial``
    again, one new mask buffer per buffer number (``buffers``)."""
    import torch

    from pipeline.dtensor.torch_compat import MaskBuffer, MaskPartial

    def leaf(p: Any) -> Any:
        if not isinstance(p, PortableMask):
            return p
        buffer = buffers.setdefault(p.buffer, MaskBuffer())
        shape = None if p.offset_shape is None else torch.Size(p.offset_shape)
        return MaskPartial(p.reduce_op, buffer, shape, p.offset_dim)

    return _map_leaves(obj, leaf)
