"""Per-pair redistribution records, the store :func:`.tables.redistribute_table` builds its
tables from: :class:`TableContext`.

A :class:`TableContext` (one per mesh shape and tensor ndim, kept in the
:class:`~.interner.PlacementInterner`) interns placement tuples to small ints and
compiles each (src, dst) pair once: its plan's steps become *step ids* (a
:class:`~.steps.StepRow`: kind, mesh dim, per-tensor-dim divisors of G and L, reshuffle
flags; equal steps share one id) and the pair's tuple of step ids a *record id*, kept
in a dense [n_placements, n_placements] matrix. Pairs involving a _StridedShard have
shape-dependent plans (DTensor's graph planner weighs steps by the tensor's bytes), so
their record ids live in one more such matrix per tensor shape. New pairs without a
_StridedShard are planned in one vectorised batch (the greedy planner of
:func:`.planner.greedy_transforms`, on arrays); those with one, one by one
(:func:`.planner.plan_normalized`). Records are shared by every table of the context,
whatever its shape, dtype or hardware: only their costs depend on those.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.distributed.tensor.placement_types import Placement

from pipeline.costmodel.redistribute.flatten import FlatGroups, flat_parts, run_row, uniform_row
from pipeline.costmodel.redistribute.graph import DTENSOR_PLAN_ERRORS, graph_state
from pipeline.costmodel.redistribute.interner import PlacementInterner
from pipeline.costmodel.redistribute.planner import plan_normalized
from pipeline.costmodel.redistribute.steps import (
    C_S,
    KIND_CODE,
    Step,
    StepRow,
    StepRows,
    category,
    check_dims,
    divisor_row,
    is_shard_like,
    mixed_partials,
    step_row,
)

__all__ = ["ILLEGAL_STEP", "NULL_STEP", "PAIR_BLOCK", "TableContext"]

NULL_STEP = 0  # padding, and steps on mesh dims of size 1: cost 0
ILLEGAL_STEP = 1  # an illegal pair's record is (ILLEGAL_STEP,): cost +inf

#: Pairs planned by one call of the batch planner (:meth:`TableContext.compile_pairs`).
PAIR_BLOCK = 1 << 18


class TableContext:
    """Interned placements, step and record stores of one (mesh shape, tensor ndim)."""

    def __init__(self, interner: PlacementInterner, mesh_shape: tuple[int, ...],
                 ndim: int) -> None:
        self.interner = interner
        self.mesh_shape = mesh_shape
        self.ndim = ndim
        # as-passed (validated) tuple -> id; and by id() of the tuple object, holding a
        # reference so the id() stays unique (placements hash in Python: slow)
        self.raw_ids: dict[tuple, int] = {}
        self.obj_ids: dict[int, tuple[Sequence[Placement], int]] = {}
        self.norm_ids: dict[tuple[Placement, ...], int] = {}  # normalized tuple -> id
        self.norms: list[tuple[Placement, ...]] = []
        self.cap = 0
        self.pids = np.zeros((0, len(mesh_shape)), dtype=np.int64)  # per id, per mesh dim
        self.strided = np.zeros(0, dtype=bool)  # per id: holds a _StridedShard
        self.mixed = np.zeros(0, dtype=bool)  # per id: mixes Partial reduce ops (illegal)
        self.sharded = np.zeros(0, dtype=bool)  # per id: holds a Shard
        # per id: holds a Shard or _StridedShard on a mesh dim of size > 1 (num_shards > 1)
        self.sharded_real = np.zeros(0, dtype=bool)
        # per id: holds a _StridedShard DTensor cannot decode into a shard order: its
        # pairs take DTensor's greedy planner (shape independent), not the graph planner
        self.undecodable = np.zeros(0, dtype=bool)
        self.graph_error = np.zeros(0, dtype=bool)
        self.any_strided = False
        self.pair = np.zeros((0, 0), dtype=np.int32)  # record id, -1 unknown
        self.shape_pair: dict[tuple[int, ...], np.ndarray] = {}  # strided pairs, per shape
        self.step_ids: dict[StepRow, int] = {}
        # step fields, one entry per step id; ids 0 and 1 are the null / illegal steps
        null = StepRow(KIND_CODE["local_partial"], 0, (1,) * ndim, (1,) * ndim, False, False)
        self.step_rows: list[StepRow] = [null, null]
        self.step_keys: dict[int, int] = {}  # batch planner's step key -> step id
        self.record_ids: dict[tuple[int, ...], int] = {}
        self.records: list[tuple[int, ...]] = []
        self._step_arrays: StepRows | None = None
        self._record_array: np.ndarray | None = None  # rows of records[:_records_done]
        self._records_done = 0
        # flattened collectives (pipeline/costmodel/redistribute/flatten.py): flattened
        # step rows (mesh_dim = index into groups.dims); per record its parts, a step id
        # (>= 0) or ~id of a flattened row; per pair the flattened row of a uniform
        # redistribution (-1: none, -2: not yet known)
        self.groups = FlatGroups(mesh_shape)
        self.flat_rows: list[StepRow] = []
        self.flat_row_ids: dict[StepRow, int] = {}
        self.flat_records: list[tuple[int, ...]] = []
        self._flat_array: np.ndarray | None = None
        self.uniform = np.zeros((0, 0), dtype=np.int32)
        # (shape, itemsize, hardware) -> (n steps, step costs, record costs)
        self.cost_cache: dict[tuple, tuple[int, np.ndarray, np.ndarray]] = {}
        self.record_id(())  # record 0: equal placements / only free steps
        self.record_id((ILLEGAL_STEP,))  # record 1: illegal

    # -- interning -------------------------------------------------------------------------

    def intern(self, placements: Sequence[Sequence[Placement]], what: str) -> np.ndarray:
        """Local ids of ``placements`` (validated and normalized on first sight)."""
        ids = np.empty(len(placements), dtype=np.intp)
        raw_ids, obj_ids = self.raw_ids, self.obj_ids
        for k, pl in enumerate(placements):
            hit = obj_ids.get(id(pl))
            if hit is not None and hit[0] is pl:
                ids[k] = hit[1]
                continue
            key = pl if type(pl) is tuple else tuple(pl)
            i = raw_ids.get(key)
            if i is None:
                check_dims(key, self.ndim, len(self.mesh_shape), what)
                norm = self.interner.normalize(key, self.ndim)
                i = self.norm_ids.get(norm)
                if i is None:
                    i = self._add(norm)
                raw_ids[key] = i
            if type(pl) is tuple:
                obj_ids[id(pl)] = (pl, i)
            ids[k] = i
        return ids

    def _add(self, norm: tuple[Placement, ...]) -> int:
        i = self.norm_ids[norm] = len(self.norms)
        self.norms.append(norm)
        if i >= self.cap:
            self._grow(max(16, 2 * self.cap))
        self.pids[i] = [self.interner.pid(p) for p in norm]
        self.strided[i] = any(category(p) == "SS" for p in norm)
        self.mixed[i] = mixed_partials(norm)
        self.sharded[i] = any(category(p) == "S" for p in norm)
        self.sharded_real[i] = any(
            is_shard_like(p) and n > 1 for p, n in zip(norm, self.mesh_shape, strict=True)
        )
        if self.strided[i]:
            try:
                self.undecodable[i] = graph_state(self.interner, norm, self.mesh_shape) is None
            except DTENSOR_PLAN_ERRORS:
                self.graph_error[i] = True  # plan_strided: None; planned one by one
        self.any_strided = self.any_strided or bool(self.strided[i])
        return i

    def _grow(self, cap: int) -> None:
        old = self.cap

        def grow(a: np.ndarray, fill: Any) -> np.ndarray:
            out = np.full((cap, *a.shape[1:]), fill, dtype=a.dtype)
            out[:old] = a
            return out

        def grow2(a: np.ndarray) -> np.ndarray:
            out = np.full((cap, cap), -1, dtype=np.int32)
            out[:old, :old] = a
            return out

        self.pids = grow(self.pids, 0)
        self.strided = grow(self.strided, False)
        self.mixed = grow(self.mixed, False)
        self.sharded = grow(self.sharded, False)
        self.sharded_real = grow(self.sharded_real, False)
        self.undecodable = grow(self.undecodable, False)
        self.graph_error = grow(self.graph_error, False)
        self.pair = grow2(self.pair)
        uni = np.full((cap, cap), -2, dtype=np.int32)
        uni[:old, :old] = self.uniform
        self.uniform = uni
        self.shape_pair = {k: grow2(v) for k, v in self.shape_pair.items()}
        self.cap = cap

    def step_id(self, row: StepRow) -> int:
        i = self.step_ids.get(row)
        if i is None:
            i = self.step_ids[row] = len(self.step_rows)
            self.step_rows.append(row)
            self._step_arrays = None
        return i

    def record_id(self, rec: tuple[int, ...]) -> int:
        i = self.record_ids.get(rec)
        if i is None:
            i = self.record_ids[rec] = len(self.records)
            self.records.append(rec)
        return i

    # -- compiling pairs -------------------------------------------------------------------

    def record_matrix(self, si: np.ndarray, di: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Record ids [len(si), len(di)], compiling the pairs not seen before."""
        ix = np.ix_(si, di)
        rec = self.pair[ix]
        strided = None
        if self.any_strided and (self.strided[si].any() or self.strided[di].any()):
            # graph-planned pairs: a _StridedShard on a side, both sides decodable
            # (or DTensor errors out on one: planned one by one as well)
            strided = (self.strided[si][:, None] | self.strided[di][None, :]) & (
                ~(self.undecodable[si][:, None] | self.undecodable[di][None, :])
                | self.graph_error[si][:, None]
                | self.graph_error[di][None, :]
            )
            if strided.any():
                sp = self.shape_pair.get(shape)
                if sp is None:
                    sp = self.shape_pair[shape] = np.full((self.cap, self.cap), -1, np.int32)
                rec = np.where(strided, sp[ix], rec)
            else:
                strided = None
        missing = rec < 0
        if missing.any():
            a, b = np.nonzero(missing)
            i, j = si[a], di[b]
            if strided is None:
                self.compile_pairs(i, j)
            else:
                s = strided[a, b]
                self.compile_pairs(i[~s], j[~s])
                sp = self.shape_pair[shape]
                for ii, jj in set(zip(i[s].tolist(), j[s].tolist(), strict=True)):
                    steps = plan_normalized(self.interner, self.norms[ii], self.norms[jj],
                                            self.mesh_shape, shape)
                    sp[ii, jj] = self.record_id(self.steps_record(steps))
                rec = np.where(strided, sp[ix], self.pair[ix])
                return rec
            rec = self.pair[ix]
        return rec

    def steps_record(self, steps: tuple[Step, ...] | None) -> tuple[int, ...]:
        """Step ids of a :func:`plan` result."""
        if steps is None:
            return (ILLEGAL_STEP,)
        mesh_shape, ndim = self.mesh_shape, self.ndim
        ids = []
        for st in steps:
            if mesh_shape[st.mesh_dim] <= 1:
                continue  # DTensor skips it; redistribute_us drops it too
            row = step_row(st, mesh_shape, ndim)
            ids.append(self.step_id(row))
        return tuple(ids)

    def compile_pairs(self, i: np.ndarray, j: np.ndarray) -> None:
        """Plan the pairs ``(i[k], j[k])`` (greedy-planned: no _StridedShard, or one DTensor
        cannot decode) with the greedy planner of :func:`.planner.plan_greedy`
        run on arrays, and store their record ids in :attr:`pair`."""
        if not len(i):
            return
        key = np.unique(i.astype(np.int64) * self.cap + j)
        i, j = key // self.cap, key % self.cap
        out = np.full(len(i), -1, dtype=np.int64)
        out[i == j] = 0
        out[(out < 0) & (self.mixed[i] | self.mixed[j])] = 1
        todo = np.flatnonzero(out < 0)
        # in blocks: the batch planner holds ~1 kB per pair while it runs (4-d meshes:
        # millions of new pairs in one table); a pair's record does not depend on the
        # others planned with it
        for lo in range(0, len(todo), PAIR_BLOCK):
            part = todo[lo: lo + PAIR_BLOCK]
            out[part] = self._batch_records(i[part], j[part])
        self.pair[i, j] = out

    def _batch_records(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Record ids of greedy-planned pairs, planned on arrays: the steps of
        :func:`.planner.greedy_transforms` + :func:`.steps.steps_from_transforms`, as
        :func:`.planner.plan`
        makes them (tests check it)."""
        pa = self.interner.arrays()
        cat, dim = pa.cat, pa.dim
        mesh_shape, ndim = self.mesh_shape, self.ndim
        n_mesh = len(mesh_shape)
        src, dst = self.pids[i], self.pids[j]
        cur = src.copy()
        slots: list[tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]] = []

        def step(valid: np.ndarray, m: int, target: np.ndarray) -> None:
            slots.append((valid, m, cur[:, m].copy(), target, cur.copy()))
            cur[:, m] = np.where(valid, target, cur[:, m])

        if n_mesh == 1:
            step(src[:, 0] != dst[:, 0], 0, dst[:, 0].copy())
        else:
            # num_shards > 1: on the canonical planning mesh without a _StridedShard, on
            # the real mesh in DTensor's fallback for an undecodable _StridedShard
            strided = self.strided[i] | self.strided[j]
            shards = np.where(strided, self.sharded_real[i], self.sharded[i])
            for m in range(n_mesh - 1, -1, -1):  # inner to outer, if src shards
                t = dst[:, m].copy()
                mismatch = np.zeros(len(i), dtype=bool)
                for k in range(m):  # outer dims, untouched so far: cur == src
                    mismatch |= (src[:, k] == t) != (dst[:, k] == t)
                t[(cat[t] == C_S) & mismatch] = self.interner.replicate
                step(shards & (cur[:, m] != t), m, t)
            for m in range(n_mesh):  # outer to inner
                step(cur[:, m] != dst[:, m], m, dst[:, m].copy())

        n_slot = len(slots)
        ids = np.zeros((len(i), n_slot), dtype=np.int64)
        illegal = np.zeros(len(i), dtype=bool)
        base = ndim + 1
        for s, (valid, m, a, b, state) in enumerate(slots):
            kind = pa.kind[a, b]
            illegal |= valid & (kind < 0)
            live = valid & (kind >= 0)
            if mesh_shape[m] <= 1 or not live.any():
                continue  # size-1 mesh dim: the null step (DTensor skips it)
            # integer key of the step row: kind, flags, own dim, mesh dim and the tensor
            # dim each other mesh dim shards (or none)
            key = kind * 2 + pa.resh[a, b]
            key = key * 2 + pa.resh_local[a, b]
            key = key * base + pa.own[a, b] + 1
            key = key * n_mesh + m
            for k in range(n_mesh):
                key = key * base + (0 if k == m else dim[state[:, k]] + 1)
            sel = np.flatnonzero(live)
            uniq, inv = np.unique(key[sel], return_inverse=True)
            uniq_ids = np.fromiter((self._key_step(int(u)) for u in uniq), np.int64, len(uniq))
            ids[sel, s] = uniq_ids[inv.reshape(-1)]
        ids[illegal] = 0
        ids[illegal, 0] = ILLEGAL_STEP
        # a record is the tuple of the non-null step ids in order; distinct rows found by
        # sorting them as raw bytes (np.unique(axis=0) lexsorts: several times slower)
        ids = np.ascontiguousarray(ids)
        as_bytes = ids.view(np.dtype((np.void, ids.itemsize * n_slot))).reshape(-1)
        uniq, inv = np.unique(as_bytes, return_inverse=True)
        rows = uniq.view(ids.dtype).reshape(-1, n_slot)
        rec = np.fromiter(
            (self.record_id(tuple(int(x) for x in r if x)) for r in rows.tolist()),
            np.int64,
            len(rows),
        )
        return rec[inv.reshape(-1)]

    def _key_step(self, key: int) -> int:
        """Step id of a batch planner step key (decoded on first sight)."""
        sid = self.step_keys.get(key)
        if sid is None:
            n_mesh, base, mesh_shape = len(self.mesh_shape), self.ndim + 1, self.mesh_shape
            rest = key
            shard_dims = []
            for _ in range(n_mesh):
                rest, r = divmod(rest, base)
                shard_dims.append(r - 1)
            shard_dims.reverse()
            rest, m = divmod(rest, n_mesh)
            rest, own = divmod(rest, base)
            rest, resh_local = divmod(rest, 2)
            kind, resh = divmod(rest, 2)
            divs = [(td, k) for k, td in enumerate(shard_dims) if td >= 0]
            row = divisor_row(kind, m, divs, own - 1 if own >= 1 else None, bool(resh),
                              bool(resh_local), mesh_shape, self.ndim)
            sid = self.step_keys[key] = self.step_id(row)
        return sid

    # -- arrays ----------------------------------------------------------------------------

    def step_arrays(self) -> StepRows:
        """Every step row so far as :class:`~.steps.StepRows` (rebuilt when rows were
        added)."""
        if self._step_arrays is None:
            self._step_arrays = StepRows.of(self.step_rows, self.ndim)
        return self._step_arrays

    def record_array(self) -> np.ndarray:
        """[n_records, width] step ids, padded with the null step (extended in place as
        records are added)."""
        arr, done, n = self._record_array, self._records_done, len(self.records)
        if arr is not None and done == n:
            return arr[:n]
        arr = self._record_array = _extended(arr, self.records, done, np.intp)
        self._records_done = n
        return arr[:n]

    def flat_row_id(self, dims: tuple[int, ...], row: StepRow) -> int:
        """Id of the flattened step ``row`` over mesh dims ``dims``."""
        row = self.groups.number(dims, row)
        i = self.flat_row_ids.get(row)
        if i is None:
            i = self.flat_row_ids[row] = len(self.flat_rows)
            self.flat_rows.append(row)
        return i

    def flat_array(self) -> np.ndarray:
        """[n_records, width] parts of every record with its runs of one collective over
        several mesh dims flattened (:func:`.flatten.flat_parts`): a step id, or ``~i``
        for flattened row ``i``; padded with the null step."""
        n, done = len(self.records), len(self.flat_records)
        if done == n and self._flat_array is not None:
            return self._flat_array[:n]
        for k in range(done, n):
            rec = self.records[k]
            if rec == (ILLEGAL_STEP,) or len(rec) < 2:
                self.flat_records.append(rec)
                continue
            rows = [self.step_rows[i] for i in rec]
            refs = [rec[p[0]] if len(p) == 1 else
                    ~self.flat_row_id(*run_row(rows, p, self.mesh_shape))
                    for p in flat_parts(rows)]
            self.flat_records.append(tuple(refs))
        # extended in place as records are added (as :meth:`record_array`)
        arr = self._flat_array = _extended(self._flat_array, self.flat_records, done, np.int64)
        return arr[:n]

    def uniform_matrix(self, si: np.ndarray, di: np.ndarray) -> np.ndarray:
        """[len(si), len(di)]: the flattened row of each pair that is uniform over two or
        more mesh dims (:func:`.flatten.uniform_row`), else -1."""
        ix = np.ix_(si, di)
        sub = self.uniform[ix]
        if (sub == -2).any():
            a, b = np.nonzero(sub == -2)
            i, j = si[a], di[b]
            ps, pd = self.pids[i], self.pids[j]
            changed = (ps != pd) & (np.asarray(self.mesh_shape) > 1)[None, :]
            first = np.argmax(changed, axis=1)
            rows = np.arange(len(i))
            same = (ps == ps[rows, first][:, None]) & (pd == pd[rows, first][:, None])
            ok = (changed.sum(axis=1) >= 2) & (~changed | same).all(axis=1)
            out = np.full(len(i), -1, dtype=np.int32)
            for k in np.flatnonzero(ok).tolist():
                found = uniform_row(self.norms[i[k]], self.norms[j[k]], self.mesh_shape,
                                    self.ndim)
                if found is not None:
                    out[k] = self.flat_row_id(*found)
            self.uniform[i, j] = out
            sub = self.uniform[ix]
        return sub


def _extended(arr: np.ndarray | None, rows: list[tuple[int, ...]], done: int,
              dtype: Any) -> np.ndarray:
    """``arr`` (rows ``[:done]`` filled, or None) with ``rows[done:]`` written after them,
    padded with the null step; reallocated (doubling, at least 64 rows) when the new rows
    do not fit in its length or width."""
    n = len(rows)
    width = max(1, max(len(r) for r in rows[done:]))
    if arr is None or width > arr.shape[1] or n > len(arr):
        old_width = 0 if arr is None else arr.shape[1]
        cap = max(n, 2 * (0 if arr is None else len(arr)), 64)
        grown = np.full((cap, max(width, old_width)), NULL_STEP, dtype=dtype)
        if arr is not None:
            grown[:done, :old_width] = arr[:done]
        arr = grown
    for k in range(done, n):
        r = rows[k]
        arr[k, : len(r)] = r
    return arr
