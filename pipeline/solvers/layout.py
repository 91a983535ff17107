"""Flat, level-scheduled arrays of an MRF, shared by TRW-S and local search.

:class:`MRFLayout` holds the arrays; :class:`pipeline.solvers.compiled.CompiledMRF`
adds the level batches built from them (:mod:`pipeline.solvers.batches`).

Why this module exists
----------------------
TRW-S and iterated conditional modes (ICM) visit the groups one by one in a
fixed order, and a visit to group ``s`` reads only the current state of its
neighbours. Issuing a handful of numpy calls per group (or per edge) costs
~1 µs each, which for ~3000 groups x 100 iterations is far too slow. We
therefore process groups in *levels*:

    level_fwd(s) = 1 + max{ level_fwd(t) : t neighbour of s, t < s }   (0 if none)

Two groups of one level are never adjacent (an edge ``t < s`` forces
``level(s) > level(t)``), and every earlier neighbour of a group lies in a
lower level. Processing the levels in increasing order, each level as one
batch of vectorised numpy calls, therefore gives exactly the result of the
sequential sweep in increasing group order: a group sees its earlier
neighbours already updated and its later neighbours not yet. The backward
sweep (decreasing order) uses ``level_bwd`` defined symmetrically. The number
of numpy calls per sweep is O(number of levels), not O(groups).

Layout
------
* Factors are compacted to the placement classes that actually occur
  (unused rows / columns of a table are dropped), so every class is used by
  at least one label; tables stay in class form ``[R_e, C_e]``.
* ``buf`` is one float64 vector: first the TRW-S messages, then every table
  row-major. Messages are stored *in class space* of their target group (a
  message ``u -> v`` of edge ``e`` is constant over labels of ``v`` with the
  same column class), ``C_e`` entries for the forward message ``u -> v`` and
  ``R_e`` entries for the backward message ``v -> u``. The messages one batch
  sends occupy one contiguous slice (edge after edge, no padding).
* The min-plus step ``mc(j) = min_i hr(i) + T(i, j)`` of a batch is one
  gather + add + ``np.minimum.reduceat`` over the flat
  ``[edge][target class][source class]`` triples (``sum_e R_e C_e`` values).
* A value ``sum_k buf[idx]`` over the incident edges of a group is gathered
  in the layout ``[group][label][incident edge]`` and summed with
  ``np.add.reduceat`` (segments of length ``deg``), so the summation order is
  fixed (deterministic, bit-identical across runs).

Nothing here builds a dense ``K_u x K_v`` matrix.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.solvers.errors import InfeasibleError
from pipeline.solvers.mrf import MRF

__all__ = ["MRFLayout"]

_INF = np.inf
_IP = np.intp


def _check_costs(arr: np.ndarray, what: str) -> None:
    if np.isnan(arr).any():
        raise ValueError(f"{what} contains NaN")
    if (arr == -_INF).any():
        raise ValueError(f"{what} contains -inf (the energy would be unbounded)")


def _compact(cls: np.ndarray, n_cls: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Map classes to ``0..R'-1`` over the classes in use; return (cls, used mask or None)."""
    used = np.zeros(n_cls, dtype=bool)
    used[cls] = True
    if used.all():
        return cls, None
    remap = np.cumsum(used) - 1
    return remap[cls], used


class MRFLayout:
    """Validated, compacted, level-scheduled arrays of an :class:`MRF`.

    Cost: one ``mrf.factor(e)`` call per edge plus O(E + sum_g K_g deg_g) numpy work.
    The ``buf`` message area is scratch space owned by the caller of
    :meth:`new_buffer`. The level batches are built from these arrays by
    pipeline/solvers/batches.py (:class:`pipeline.solvers.compiled.CompiledMRF`):
    ``_fwd_levels`` / ``_bwd_levels`` / ``_all_levels`` the levels, ``_fwd_send`` /
    ``_bwd_send`` the edges each level sends along, and the build-time gathers
    ``_th_idx``, ``_dec_static``, ``_icm_static``; ``pairs[s]`` holds, per incident
    edge of group ``s``, the neighbour, its class-map offset in ``cls_flat`` and the
    class multipliers of the decoding and ICM gathers.

    Raises:
        ValueError: malformed input (shapes, edge order, class indices, NaN,
            ``-inf``).
        InfeasibleError: a group has every label forbidden.
    """

    def __init__(self, mrf: MRF, order: np.ndarray | None = None) -> None:
        self._load(mrf)
        self._permute(order)
        self._schedule()
        self._layout(mrf.share)
        self._build_node_arrays()

    # ------------------------------------------------------------------ load
    def _load(self, mrf: MRF) -> None:
        sizes = np.asarray(mrf.domain_sizes, dtype=np.int64).reshape(-1)
        n = int(sizes.shape[0])
        if n and sizes.min() < 1:
            raise ValueError("MRF.domain_sizes must all be >= 1")
        if len(mrf.unary) != n:
            raise ValueError(f"MRF.unary has {len(mrf.unary)} entries for {n} groups")
        unary = []
        for g in range(n):
            u = np.asarray(mrf.unary[g], dtype=np.float64)
            if u.shape != (sizes[g],):
                raise ValueError(f"unary[{g}] has shape {u.shape}, expected ({sizes[g]},)")
            _check_costs(u, f"unary[{g}]")
            if not np.isfinite(u).any():
                raise InfeasibleError(f"group {g}: every label is forbidden (+inf unary)")
            unary.append(u)
        edges = np.asarray(mrf.edges, dtype=np.int64).reshape(-1, 2)
        if edges.size:
            if edges.min() < 0 or edges.max() >= n:
                raise ValueError("MRF.edges refers to a group index out of range")
            if (edges[:, 0] >= edges[:, 1]).any():
                raise ValueError("MRF.edges rows must satisfy u < v")
            keys = edges[:, 0] * n + edges[:, 1]
            if np.unique(keys).size != keys.size:
                raise ValueError("MRF.edges contains a repeated (u, v) pair")
        n_edges = int(edges.shape[0])
        rcls, ccls, tables = [], [], []
        used: list[tuple[np.ndarray | None, np.ndarray | None]] = []
        for e in range(n_edges):
            u, v = int(edges[e, 0]), int(edges[e, 1])
            f = mrf.factor(e)
            t = np.asarray(f.table, dtype=np.float64)
            rc = np.asarray(f.row_cls).astype(_IP, copy=False)
            cc = np.asarray(f.col_cls).astype(_IP, copy=False)
            if t.ndim != 2 or rc.shape != (sizes[u],) or cc.shape != (sizes[v],):
                raise ValueError(
                    f"factor({e}) on ({u}, {v}): row_cls {rc.shape}, col_cls {cc.shape}, "
                    f"table {t.shape} do not match domain sizes ({sizes[u]}, {sizes[v]})"
                )
            if rc.min() < 0 or rc.max() >= t.shape[0] or cc.min() < 0 or cc.max() >= t.shape[1]:
                raise ValueError(f"factor({e}): class index outside the table")
            _check_costs(t, f"factor({e}).table")
            rc, used_r = _compact(rc, t.shape[0])
            cc, used_c = _compact(cc, t.shape[1])
            rcls.append(rc)
            ccls.append(cc)
            # the factor's own table (no copy); the classes in use are kept in the
            # store by :meth:`_layout`
            tables.append(t)
            used.append((used_r, used_c))
        self.num_groups = n
        self.num_edges = n_edges
        self.sizes = sizes
        self.unary = unary
        self.edges = edges
        self.constant = float(mrf.constant)
        self.rcls = rcls
        self.ccls = ccls
        self.tables = tables
        self._used = used
        self.R = np.array([t.shape[0] if ur is None else int(ur.sum())
                           for t, (ur, _) in zip(tables, used, strict=True)], dtype=_IP)
        self.C = np.array([t.shape[1] if uc is None else int(uc.sum())
                           for t, (_, uc) in zip(tables, used, strict=True)], dtype=_IP)

    def _permute(self, order: np.ndarray | None) -> None:
        """Renumber groups so that internal index ``i`` is group ``order[i]``.

        Edges whose endpoints swap their relative order get their factor
        transposed (row and column classes exchanged), so ``u < v`` still holds.
        """
        n = self.num_groups
        self._flipped = np.zeros(0, dtype=np.int64)
        if order is None:
            self.order = np.arange(n, dtype=np.int64)
            self.pos = self.order
            return
        order = np.asarray(order, dtype=np.int64).reshape(-1)
        if order.shape != (n,) or not np.array_equal(np.sort(order), np.arange(n)):
            raise ValueError("order must be a permutation of the group indices")
        pos = np.empty(n, dtype=np.int64)
        pos[order] = np.arange(n)
        self.order, self.pos = order, pos
        self.sizes = self.sizes[order]
        self.unary = [self.unary[s] for s in order]
        if self.num_edges == 0:
            return
        a, b = pos[self.edges[:, 0]], pos[self.edges[:, 1]]
        flip = self._flipped = np.flatnonzero(a > b)
        for e in flip:
            self.rcls[e], self.ccls[e] = self.ccls[e], self.rcls[e]
            self.tables[e] = self.tables[e].T  # a view; :meth:`_layout` copies it once
            self._used[e] = self._used[e][::-1]
        self.edges = np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1)
        self.R[flip], self.C[flip] = self.C[flip], self.R[flip]

    def to_internal(self, labels: np.ndarray) -> np.ndarray:
        """Labels indexed by group -> labels indexed by internal position."""
        return np.asarray(labels, dtype=np.int64)[self.order]

    def to_external(self, labels: np.ndarray) -> np.ndarray:
        """Labels indexed by internal position -> labels indexed by group."""
        out = np.empty_like(labels)
        out[self.order] = labels
        return out

    # -------------------------------------------------------------- schedule
    def _schedule(self) -> None:
        n = self.num_groups
        inc: list[list[int]] = [[] for _ in range(n)]
        for e in range(self.num_edges):
            u, v = int(self.edges[e, 0]), int(self.edges[e, 1])
            inc[u].append(e)
            inc[v].append(e)
        self.inc = inc
        # Position of edge e in inc[u] and in inc[v] (inc lists are in edge order).
        self.pos_u = np.zeros(self.num_edges, dtype=_IP)
        self.pos_v = np.zeros(self.num_edges, dtype=_IP)
        for s in range(n):
            for j, e in enumerate(inc[s]):
                if int(self.edges[e, 0]) == s:
                    self.pos_u[e] = j
                else:
                    self.pos_v[e] = j
        n_in = np.zeros(n, dtype=np.int64)
        n_out = np.zeros(n, dtype=np.int64)
        if self.num_edges:
            np.add.at(n_in, self.edges[:, 1], 1)
            np.add.at(n_out, self.edges[:, 0], 1)
        self.n_in, self.n_out = n_in, n_out
        deg = n_in + n_out
        self.isolated = np.flatnonzero(deg == 0)
        n_chain = np.maximum(np.maximum(n_in, n_out), 1)
        # gamma_s = 1 / max(n_in, n_out) (Kolmogorov 2006, TRW-S; MRFEnergy SetMonotonicTrees).
        self.gamma = 1.0 / n_chain
        # Bound coefficient: chains starting at s divided by chains through s.
        self.coef = np.where(deg > 0, (n_chain - n_in) / n_chain, 1.0)
        lev_f = np.zeros(n, dtype=np.int64)
        for s in range(n):
            best = -1
            for e in inc[s]:
                t = int(self.edges[e, 0])
                if t < s and lev_f[t] > best:
                    best = lev_f[t]
            lev_f[s] = best + 1
        lev_b = np.zeros(n, dtype=np.int64)
        for s in range(n - 1, -1, -1):
            best = -1
            for e in inc[s]:
                t = int(self.edges[e, 1])
                if t > s and lev_b[t] > best:
                    best = lev_b[t]
            lev_b[s] = best + 1
        connected = deg > 0

        def groups(level: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
            idx = np.flatnonzero(mask)
            if idx.size == 0:
                return []
            order = idx[np.argsort(level[idx], kind="stable")]
            cuts = np.flatnonzero(np.diff(level[order])) + 1
            return [a.astype(_IP) for a in np.split(order, cuts)]

        self._fwd_levels = groups(lev_f, n_out > 0)
        self._bwd_levels = groups(lev_b, connected)
        self._all_levels = groups(lev_f, connected)

    # ---------------------------------------------------------------- layout
    def _layout(self, share: Any = None) -> None:
        """Assign message slots (forward then backward area) and table offsets; copy
        the tables into the store, offering each copy that equals its factor's table
        (not compacted, not transposed) to ``share`` (:attr:`MRF.share`)."""
        n_edges = self.num_edges
        slot_f = np.zeros(n_edges, dtype=_IP)
        slot_b = np.zeros(n_edges, dtype=_IP)
        pos = 0
        self._fwd_send: list[list[int]] = []
        for nodes in self._fwd_levels:
            send = [e for s in nodes for e in self.inc[s] if int(self.edges[e, 0]) == s]
            for e in send:
                slot_f[e] = pos
                pos += int(self.C[e])
            self._fwd_send.append(send)
        self._bwd_send: list[list[int]] = []
        for nodes in self._bwd_levels:
            send = [e for s in nodes for e in self.inc[s] if int(self.edges[e, 1]) == s]
            for e in send:
                slot_b[e] = pos
                pos += int(self.R[e])
            self._bwd_send.append(send)
        self.msg_size = pos
        # Position of every sent message in the per-pass normalisation-constant vector.
        self.cpos_f = np.zeros(n_edges, dtype=_IP)
        self.cpos_b = np.zeros(n_edges, dtype=_IP)
        self.cpos_f[[e for send in self._fwd_send for e in send]] = np.arange(n_edges)
        self.cpos_b[[e for send in self._bwd_send for e in send]] = np.arange(n_edges)
        self.slot_f, self.slot_b = slot_f, slot_b
        sizes_rc = self.R * self.C
        self.tab_off = pos + np.concatenate([[0], np.cumsum(sizes_rc)[:-1]]).astype(_IP)
        if n_edges == 0:
            self.tab_off = np.zeros(0, dtype=_IP)
        # One array holds the zero messages and every table (the first buffer handed out,
        # :meth:`new_buffer`); ``tables[e]`` become views of it, so a table is stored once.
        flipped = set(self._flipped.tolist())
        store = np.empty(pos + int(sizes_rc.sum()))
        store[:pos] = 0.0
        for e in range(n_edges):
            lo = int(self.tab_off[e])
            view = store[lo: lo + int(sizes_rc[e])].reshape(int(self.R[e]), int(self.C[e]))
            t, (used_r, used_c) = self.tables[e], self._used[e]
            if used_r is None and used_c is None:
                view[...] = t
                if share is not None and e not in flipped:
                    self.tables[e] = t = None  # the factor's table may go now
                    share(e, view)
            else:  # the classes in use only (compacted, module docstring)
                rows = np.flatnonzero(used_r) if used_r is not None else np.arange(t.shape[0])
                cols = np.flatnonzero(used_c) if used_c is not None else np.arange(t.shape[1])
                view[...] = t[np.ix_(rows, cols)]
            self.tables[e] = view
        del self._used
        self._store = store
        self._handed = False
        self._tab_flat = store[pos:]
        # Class maps, flat: row classes of edge e at rc_off[e], column classes at cc_off[e].
        parts, off = [], 0
        rc_off = np.zeros(n_edges, dtype=_IP)
        cc_off = np.zeros(n_edges, dtype=_IP)
        for e in range(n_edges):
            rc_off[e] = off
            off += self.rcls[e].size
            cc_off[e] = off
            off += self.ccls[e].size
            parts += [self.rcls[e], self.ccls[e]]
        self.cls_flat = np.concatenate(parts).astype(_IP) if parts else np.zeros(0, dtype=_IP)
        self.rc_off, self.cc_off = rc_off, cc_off
        k = self.sizes
        self.un_off = np.concatenate([[0], np.cumsum(k)[:-1]]).astype(_IP) if k.size else k
        self.unary_flat = np.concatenate(self.unary) if self.unary else np.zeros(0)

    def new_buffer(self) -> np.ndarray:
        """Return a fresh ``buf``: zero messages followed by the tables.

        The first call hands out the compiled store itself (its tables are
        ``tables[e]``, never written: a pass writes only the message area), later
        calls a copy with zero messages, so one solve keeps one copy of the tables.
        """
        if not self._handed:
            self._handed = True
            return self._store
        buf = self._store.copy()
        buf[: self.msg_size] = 0.0
        return buf

    # ------------------------------------------------------------ node arrays
    def _build_node_arrays(self) -> None:
        """Per group: message gather index and the static parts of the cost gathers."""
        n = self.num_groups
        self._th_idx: list[np.ndarray | None] = [None] * n
        self._dec_static: list[np.ndarray | None] = [None] * n
        self._icm_static: list[np.ndarray | None] = [None] * n
        self.pairs: list[tuple[np.ndarray, ...] | None] = [None] * n
        edges, tab_off = self.edges, self.tab_off
        for s in range(n):
            inc = self.inc[s]
            if not inc:
                continue
            k = int(self.sizes[s])
            th = np.empty((k, len(inc)), dtype=_IP)
            dec = np.empty((k, len(inc)), dtype=_IP)
            icm = np.empty((k, len(inc)), dtype=_IP)
            nbr = np.empty(len(inc), dtype=_IP)
            clsoff = np.empty(len(inc), dtype=_IP)
            mult_dec = np.empty(len(inc), dtype=_IP)
            mult_icm = np.empty(len(inc), dtype=_IP)
            for j, e in enumerate(inc):
                u, v = int(edges[e, 0]), int(edges[e, 1])
                c = int(self.C[e])
                if s == v:  # earlier neighbour u: forward message, value T[rc[x_u], cc[x]]
                    cls = self.ccls[e]
                    th[:, j] = self.slot_f[e] + cls
                    dec[:, j] = tab_off[e] + cls
                    icm[:, j] = dec[:, j]
                    nbr[j] = u
                    clsoff[j] = self.rc_off[e]
                    mult_dec[j] = mult_icm[j] = c
                else:  # later neighbour v: backward message, value T[rc[x], cc[x_v]]
                    cls = self.rcls[e]
                    th[:, j] = self.slot_b[e] + cls
                    dec[:, j] = th[:, j]
                    icm[:, j] = tab_off[e] + cls * c
                    nbr[j] = v
                    clsoff[j] = self.cc_off[e]
                    mult_dec[j] = 0
                    mult_icm[j] = 1
            self._th_idx[s] = th.ravel()
            self._dec_static[s] = dec.ravel()
            self._icm_static[s] = icm.ravel()
            self.pairs[s] = (nbr, clsoff, mult_dec, mult_icm)
        # Per-group ICM arrays, kept 2-D for the pairwise move.
        self.icm_static_2d = [
            None if a is None else a.reshape(int(self.sizes[s]), -1)
            for s, a in enumerate(self._icm_static)
        ]

    # ---------------------------------------------------------- evaluation
    def isolated_labels(self) -> np.ndarray:
        """Best label of every isolated group (argmin of its unary), int64 ``[n_isolated]``."""
        return np.array([int(np.argmin(self.unary[s])) for s in self.isolated], dtype=np.int64)

    def local_costs(self, buf: np.ndarray, labels: np.ndarray, s: int) -> np.ndarray:
        """Per-edge costs of every label of group ``s`` given its neighbours' labels.

        Returns float64 ``[K_s, deg_s]``: column ``j`` is ``B_e(x, labels[t])``
        for the ``j``-th incident edge ``e`` (in edge order) to neighbour ``t``.
        """
        nbr, clsoff, _, mult = self.pairs[s]
        dyn = self.cls_flat[clsoff + labels[nbr]] * mult
        return buf[self.icm_static_2d[s] + dyn]

    def energy(self, labels: np.ndarray) -> float:
        """Vectorised ``E(labels)`` in µs (``+inf`` if forbidden).

        Equal to ``MRF.evaluate`` up to floating-point summation order; used
        to rank candidate labellings, never reported.
        """
        total = self.constant + float(self.unary_flat[self.un_off + labels].sum())
        if self.num_edges:
            u, v = self.edges[:, 0], self.edges[:, 1]
            r = self.cls_flat[self.rc_off + labels[u]]
            c = self.cls_flat[self.cc_off + labels[v]]
            total += float(self._tab_flat[self.tab_off - self.msg_size + r * self.C + c].sum())
        return total
