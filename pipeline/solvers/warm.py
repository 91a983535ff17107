r"""Warm start of TRW-S: begin from the messages of an earlier solve of the same layout.

Use: the step-time search (pipeline/stages/solve/objective.py) solves a sequence of
MRFs with the same groups, labels, edges and placement classes, only the tables and
unaries changing (re-weighted redistributions, Lagrangian multipliers). Each solve can
start from the messages the previous one ended with instead of zeros; near the
previous optimum that saves passes (llama1b 2x4x8, 2026-12-03: the planner domain's
four rounds took 22, 99, 41, 72 TRW-S iterations from zeros, 17, 83, 20, 54 warm; the
fsdp_tp_cp recipe's 36, 30, 28, 27 against 36, 10, 7, 6; the same certified plans).

Why any messages are a valid start
----------------------------------
The notation is :mod:`pipeline.solvers.trws`'s. The messages only *define* a
reparametrisation ``theta_bar`` (``theta_bar_s = theta_s + sum_t M_ts``, ``theta_bar_st
= theta_st - M_ts - M_st``), and ``E(x) = const + sum_s theta_bar_s(x_s) + sum_st
theta_bar_st(x_s, x_t)`` holds for *every* finite vector of messages: the ``M`` terms
cancel label by label. The bound of an iteration is computed at the end of its
backward pass, where every backward message ``M_st`` (``s > t``) has just been
recomputed from ``theta_hat_s`` as it is at the end of the pass (the backward messages
into ``s`` were sent before ``s``'s visit, the forward ones are not touched by the
backward pass). That, and nothing about the messages the iteration started from, is
what collapses each monotonic chain into the constants ``c_ts`` (trws.py, "Lower
bound"); so the bound is ``<= min E`` whatever the starting messages were, and TRW-S's
monotonicity ([K06] Sec. 4) holds from any start as well. The labelling, the polish
and the certificate (``objective <= bound (1 + 1e-9)``) are unchanged.

The one thing an old message may carry that a new problem does not justify is ``+inf``
(a label of the old problem shown to be in no finite-energy plan): with ``+inf`` the
reparametrisation above is undefined (``inf - inf``). :meth:`WarmStart.load` therefore
replaces every ``+inf`` entry by 0 (a finite message, so a valid start); the first
forward and backward passes mark the labels the *new* problem forbids ``+inf`` again,
exactly as from zeros (trws.py, "``+inf`` handling").

Same layout: the message area of the compiled buffer is laid out by the visiting
order, the edges, the compacted class counts and the class maps
(pipeline/solvers/layout.py). A start is used only when all of these equal those of
the solve that saved it (:meth:`WarmStart.key`); otherwise the solve starts from zeros
(``extra["warm_start"]`` is False) and saves its own messages for the next one.
"""

from __future__ import annotations

import hashlib

import numpy as np

from pipeline.solvers.layout import MRFLayout

__all__ = ["WarmStart"]


class WarmStart:
    """The messages of the last TRW-S solve that was given this object
    (:func:`pipeline.solvers.trws.solve_trws`, ``warm=``), for the next one.

    ``load=False`` records without starting from what it holds (the first solve of a
    sequence whose result must be that of a cold start). ``loads`` / ``saves`` count
    the solves that started from the held messages / left theirs.
    """

    def __init__(self, load: bool = True) -> None:
        self.load_enabled = load
        self._key: bytes | None = None
        self._messages: np.ndarray | None = None
        self.loads = 0
        self.saves = 0

    @staticmethod
    def key(cm: MRFLayout) -> bytes:
        """A digest of what fixes the message area's layout (module docstring)."""
        h = hashlib.blake2b(digest_size=32)
        h.update(np.asarray([cm.num_groups, cm.num_edges, cm.msg_size], np.int64).tobytes())
        for arr in (cm.order, cm.sizes, cm.edges, cm.R, cm.C, cm.slot_f, cm.slot_b,
                    cm.cls_flat):
            a = np.ascontiguousarray(arr, dtype=np.int64)
            h.update(np.asarray(a.shape, np.int64).tobytes())
            h.update(a.tobytes())
        return h.digest()

    def load(self, cm: MRFLayout, buf: np.ndarray) -> bool:
        """Write the held messages into ``buf``'s message area (``+inf`` as 0) when
        loading is enabled and ``cm`` has the layout they were saved from; returns
        whether it did (else ``buf`` is untouched: a cold start)."""
        if not self.load_enabled or self._messages is None or self._key != self.key(cm):
            return False
        np.copyto(buf[: cm.msg_size], np.where(np.isinf(self._messages), 0.0, self._messages))
        self.loads += 1
        return True

    def save(self, cm: MRFLayout, buf: np.ndarray) -> None:
        """Keep a copy of ``buf``'s message area and ``cm``'s layout key."""
        self._key = self.key(cm)
        self._messages = np.array(buf[: cm.msg_size], dtype=np.float64, copy=True)
        self.saves += 1
