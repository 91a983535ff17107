"""A compiled MRF: the flat arrays of :mod:`pipeline.solvers.layout` and the level
batches of :mod:`pipeline.solvers.batches` built from them, shared by TRW-S and local
search (the layout module explains the level-by-level sweep and the array layout).
"""

from __future__ import annotations

import numpy as np

from pipeline.solvers.batches import (
    CondBatch,
    SendBatch,
    cond_batch,
    conditional_sweep,
    index_order_levels,
    interleaved_order,
    send_batch,
)
from pipeline.solvers.layout import MRFLayout
from pipeline.solvers.mrf import MRF

# Re-exported: the batches were built here before pipeline/solvers/batches.py existed.
__all__ = [
    "CompiledMRF",
    "CondBatch",
    "SendBatch",
    "conditional_sweep",
    "index_order_levels",
    "interleaved_order",
]


class CompiledMRF(MRFLayout):
    """The arrays of an :class:`MRF` (:class:`MRFLayout`) and their level batches.

    Build once per solve and share it between TRW-S and the local search. The batches:
    ``fwd_batches`` / ``bwd_batches`` (:class:`SendBatch`, the TRW-S passes),
    ``decode_batches`` / ``icm_batches`` (:class:`CondBatch`, the labelling sweeps).

    Raises:
        ValueError: malformed input (shapes, edge order, class indices, NaN,
            ``-inf``).
        InfeasibleError: a group has every label forbidden.
    """

    def __init__(self, mrf: MRF, order: np.ndarray | None = None) -> None:
        super().__init__(mrf, order)
        self.fwd_batches = [
            send_batch(self, nodes, send, self._th_idx, forward=True)
            for nodes, send in zip(self._fwd_levels, self._fwd_send, strict=True)
        ]
        self.bwd_batches = [
            send_batch(self, nodes, send, self._th_idx, forward=False)
            for nodes, send in zip(self._bwd_levels, self._bwd_send, strict=True)
        ]
        self.decode_batches = [cond_batch(self, b, self._dec_static, decode=True)
                               for b in self._all_levels]
        self.icm_batches = [cond_batch(self, b, self._icm_static, decode=False)
                            for b in self._all_levels]
        del self._th_idx, self._dec_static  # build-time only
