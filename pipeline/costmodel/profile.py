"""Measured hardware tables (a *profile*): their format, validation and interpolation.

A hardware config (``conf/hardware/<name>.yaml``, :class:`~pipeline.costmodel.hardware.
HardwareConfig`) may carry a ``tables`` mapping written by ``python -m pipeline.calibrate``
(pipeline/tools/calibrate/) or by hand. Where a table covers an op or a collective the
cost model reads it; otherwise it uses the config's constants (``compute_efficiency``,
``memory_efficiency``, the link model of :mod:`pipeline.costmodel.comm`). The format
(every entry required, every number finite; times in µs, bandwidths in GB/s = 1e9 B/s as
nccl-tests prints them)::

    tables:
      version: 1
      date: 2026-12-03T12:00:00Z         # when it was measured
      torch: 2.13.0                       # torch.__version__ of the measurement
      device: "cpu: AMD EPYC ..."         # what was measured
      method: "..."                       # repetitions, statistic, peak definition
      measured: [matmul, attention, ...]  # tables measured on this machine
      from_constants: [...]               # config keys that are not measurements
      matmul:      # FLOP-rate efficiency by shape, dtype and pass; a full M x N x K grid
        - {dtype: float32, pass: fwd, m: 64, n: 64, k: 64, time_us: 12.0, efficiency: 0.4}
      attention:   # scaled_dot_product_attention by sequence, head dim, causal mask
        - {dtype: float32, pass: fwd, batch_heads: 8, seq: 128, head_dim: 64,
           causal: false, time_us: 50.0, efficiency: 0.3}
      memory:      # a memory-bound kernel (copy): bytes moved (read + write) -> GB/s
        - {bytes: 1048576, time_us: 100.0, bandwidth: 10.5}
      launch_us: 4.0                      # per-kernel launch overhead (an empty kernel)
      collectives: # the nccl-tests table per kind x group layout
        - {kind: all_gather, per_node: 2, nodes: 1, backend: gloo,
           rows: [{size: 1024, time_us: 30.0, algbw: 0.03, busbw: 0.017}, ...]}

Efficiency is ``FLOPs / (time * peak)`` with the FLOPs the cost model counts for the op
(:func:`pipeline.costmodel.compute.op_flops`) and the config's peak for the dtype, so a
table entry reproduces its measured time exactly. Sizes and the grid's axes are strictly
increasing.

Interpolation (:func:`interp_log`, :func:`interp_grid_log`): linear in ``log2`` of the
size (of each of ``M, N, K`` for the matmul grid, multilinear), the usual choice for
quantities measured on a geometric grid of sizes (nccl-tests sweeps sizes by a factor).
A point outside the table is clamped to its nearest end and counted as *outside*
(:class:`Tables.counts`, reported in ``run.json`` as ``hardware_tables``). Collective
tables give the bus bandwidth at a size; the time is then nccl-tests' own relation
``time = factor (n-1)/n * S / busbw`` (:mod:`pipeline.costmodel.comm`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "PASSES",
    "TABLE_KINDS",
    "TablesError",
    "Tables",
    "interp_grid_log",
    "interp_log",
    "validate_tables",
]

#: Version of the ``tables`` format.
VERSION = 1
#: Forward / backward passes of a matmul or attention entry.
PASSES = ("fwd", "bwd")
#: The tables a profile may hold (each optional), in the order of the format.
TABLE_KINDS = ("matmul", "attention", "memory", "launch_us", "collectives")
_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
_HEADER = ("version", "date", "torch", "device", "method", "measured", "from_constants")


class TablesError(ValueError):
    """A profile's tables are malformed: the message is one line naming the entry."""


# --------------------------------------------------------------------------- validation


def _plain(obj: Any) -> Any:
    """A DictConfig / ListConfig as plain containers (other values unchanged)."""
    if type(obj).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(obj, resolve=True)
    return obj


def _num(where: str, value: Any, *, positive: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        allowed = "a number > 0" if positive else "a number >= 0"
        raise TablesError(f"hardware.tables.{where}={value!r} is invalid: must be {allowed}")
    return float(value)


def _int(where: str, value: Any) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise TablesError(f"hardware.tables.{where}={value!r} is invalid: must be an integer >= 1")
    return value


def _choice(where: str, value: Any, allowed: Sequence[Any]) -> Any:
    if value not in allowed:
        raise TablesError(f"hardware.tables.{where}={value!r} is invalid: allowed "
                          + ", ".join(str(a) for a in allowed))
    return value


def _rows(tables: Mapping, key: str) -> list:
    rows = tables.get(key)
    if not isinstance(rows, list) or not rows:
        raise TablesError(f"hardware.tables.{key}={rows!r} is invalid: must be a non-empty list")
    return rows


def _need(where: str, row: Any, keys: Sequence[str]) -> None:
    if not isinstance(row, Mapping):
        raise TablesError(f"hardware.tables.{where}={row!r} is invalid: must be a mapping")
    missing = [k for k in keys if k not in row]
    if missing:
        raise TablesError(f"hardware.tables.{where}.{missing[0]} is missing: each entry needs "
                          + ", ".join(keys))


def _increasing(where: str, values: Sequence[float]) -> None:
    for a, b in zip(values, values[1:]):
        if not b > a:
            raise TablesError(f"hardware.tables.{where}: sizes {a!r} then {b!r} are not "
                              "strictly increasing")


_MATMUL = ("dtype", "pass", "m", "n", "k", "time_us", "efficiency")
_ATTN = ("dtype", "pass", "batch_heads", "seq", "head_dim", "causal", "time_us", "efficiency")
_MEMORY = ("bytes", "time_us", "bandwidth")
_COLL = ("kind", "per_node", "nodes", "backend", "rows")
_COLL_ROW = ("size", "time_us", "algbw", "busbw")


def validate_tables(tables: Any) -> None:
    """Check a profile's ``tables`` (module docstring): every entry present, every number
    finite and > 0 (counts >= 1), known dtypes / passes / kinds, a full matmul grid per
    (dtype, pass), strictly increasing sizes in every 1-d table.

    Raises:
        TablesError: one line naming the entry, its value and what is allowed.
    """
    t = _plain(tables)
    if not isinstance(t, Mapping):
        raise TablesError(f"hardware.tables={t!r} is invalid: must be a mapping or null")
    for key in _HEADER:
        if key not in t:
            raise TablesError(f"hardware.tables.{key} is missing: a profile states "
                              + ", ".join(_HEADER))
    if t["version"] != VERSION:
        raise TablesError(f"hardware.tables.version={t['version']!r} is invalid: allowed {VERSION}")
    for key in ("measured", "from_constants"):
        if not isinstance(t[key], list) or not all(isinstance(v, str) for v in t[key]):
            raise TablesError(f"hardware.tables.{key}={t[key]!r} is invalid: a list of names")
    unknown = sorted(set(t) - set(_HEADER) - set(TABLE_KINDS))
    if unknown:
        raise TablesError(f"hardware.tables.{unknown[0]} is not a table: allowed "
                          + ", ".join(TABLE_KINDS))
    if "matmul" in t:
        grids: dict[tuple, set] = {}
        for i, r in enumerate(_rows(t, "matmul")):
            _need(f"matmul[{i}]", r, _MATMUL)
            _choice(f"matmul[{i}].pass", r["pass"], PASSES)
            for k in ("m", "n", "k"):
                _int(f"matmul[{i}].{k}", r[k])
            for k in ("time_us", "efficiency"):
                _num(f"matmul[{i}].{k}", r[k])
            key = (str(r["dtype"]), r["pass"])
            point = (r["m"], r["n"], r["k"])
            if point in grids.setdefault(key, set()):
                raise TablesError(f"hardware.tables.matmul[{i}]: shape {point} appears twice "
                                  f"for {key[0]} {key[1]}")
            grids[key].add(point)
        for key, points in grids.items():
            axes = [sorted({p[d] for p in points}) for d in range(3)]
            if len(points) != len(axes[0]) * len(axes[1]) * len(axes[2]):
                raise TablesError(f"hardware.tables.matmul: {key[0]} {key[1]} is not a full "
                                  f"M x N x K grid ({len(points)} of "
                                  f"{len(axes[0]) * len(axes[1]) * len(axes[2])} shapes)")
    if "attention" in t:
        lines: dict[tuple, list] = {}
        for i, r in enumerate(_rows(t, "attention")):
            _need(f"attention[{i}]", r, _ATTN)
            _choice(f"attention[{i}].pass", r["pass"], PASSES)
            _choice(f"attention[{i}].causal", r["causal"], (True, False))
            for k in ("batch_heads", "seq", "head_dim"):
                _int(f"attention[{i}].{k}", r[k])
            for k in ("time_us", "efficiency"):
                _num(f"attention[{i}].{k}", r[k])
            lines.setdefault((str(r["dtype"]), r["pass"], r["head_dim"], r["causal"]),
                             []).append(r["seq"])
        for key, seqs in lines.items():
            _increasing(f"attention ({key[0]} {key[1]} head_dim={key[2]} causal={key[3]})",
                        seqs)
    if "memory" in t:
        rows = _rows(t, "memory")
        for i, r in enumerate(rows):
            _need(f"memory[{i}]", r, _MEMORY)
            _int(f"memory[{i}].bytes", r["bytes"])
            for k in ("time_us", "bandwidth"):
                _num(f"memory[{i}].{k}", r[k])
        _increasing("memory", [r["bytes"] for r in rows])
    if "launch_us" in t:
        _num("launch_us", t["launch_us"], positive=False)
    if "collectives" in t:
        seen = set()
        for i, c in enumerate(_rows(t, "collectives")):
            _need(f"collectives[{i}]", c, _COLL)
            _choice(f"collectives[{i}].kind", c["kind"], _COLLECTIVES)
            _int(f"collectives[{i}].per_node", c["per_node"])
            _int(f"collectives[{i}].nodes", c["nodes"])
            if c["per_node"] * c["nodes"] < 2:
                raise TablesError(f"hardware.tables.collectives[{i}]: a group of "
                                  f"{c['per_node'] * c['nodes']} rank has no collective")
            key = (c["kind"], c["per_node"], c["nodes"])
            if key in seen:
                raise TablesError(f"hardware.tables.collectives[{i}]: {key[0]} on "
                                  f"{key[1]} x {key[2]} appears twice")
            seen.add(key)
            rows = c["rows"]
            if not isinstance(rows, list) or not rows:
                raise TablesError(f"hardware.tables.collectives[{i}].rows={rows!r} is "
                                  "invalid: must be a non-empty list")
            for j, r in enumerate(rows):
                _need(f"collectives[{i}].rows[{j}]", r, _COLL_ROW)
                _int(f"collectives[{i}].rows[{j}].size", r["size"])
                for k in ("time_us", "algbw", "busbw"):
                    _num(f"collectives[{i}].rows[{j}].{k}", r[k])
            _increasing(f"collectives[{i}] ({c['kind']})", [r["size"] for r in rows])


# --------------------------------------------------------------------------- interpolation


def interp_log(x: float, xs: Sequence[float], ys: Sequence[float]) -> tuple[float, bool]:
    """``y`` at ``x`` by linear interpolation in ``log2 x`` between the points
    ``(xs[i], ys[i])`` (``xs`` strictly increasing, > 0), and whether ``x`` lay outside
    ``[xs[0], xs[-1]]`` (then the nearest end's ``y``).

    Example: ``xs = (1024, 4096)``, ``ys = (1, 3)``: ``x = 2048`` is half way in log2
    (11 between 10 and 12), ``y = 2``.
    """
    if x <= xs[0] or len(xs) == 1:
        return float(ys[0]), bool(x < xs[0] or (len(xs) == 1 and x != xs[0]))
    if x >= xs[-1]:
        return float(ys[-1]), bool(x > xs[-1])
    lx = np.log2(np.asarray(xs, dtype=np.float64))
    return float(np.interp(math.log2(x), lx, np.asarray(ys, dtype=np.float64))), False


def interp_grid_log(point: Sequence[float], axes: Sequence[Sequence[float]],
                    values: np.ndarray) -> tuple[float, bool]:
    """Multilinear interpolation in ``log2`` of each coordinate on a full grid:
    ``values[i, j, ...]`` at ``(axes[0][i], axes[1][j], ...)``; a coordinate outside its
    axis is clamped to the nearest end. Returns ``(value, outside)``.

    Example, one axis ``(64, 256)`` and values ``(0.2, 0.6)``: at 128 (log2 7, half way
    between 6 and 8) the value is 0.4.
    """
    weights = []  # per axis: ((index, weight), ...)
    outside = False
    for x, ax in zip(point, axes):
        ax = np.asarray(ax, dtype=np.float64)
        if len(ax) == 1 or x <= ax[0]:
            outside |= bool(x != ax[0]) if len(ax) == 1 else bool(x < ax[0])
            weights.append(((0, 1.0),))
            continue
        if x >= ax[-1]:
            outside |= bool(x > ax[-1])
            weights.append(((len(ax) - 1, 1.0),))
            continue
        hi = int(np.searchsorted(ax, x, side="right"))
        lo = hi - 1
        w = (math.log2(x) - math.log2(ax[lo])) / (math.log2(ax[hi]) - math.log2(ax[lo]))
        weights.append(((lo, 1.0 - w), (hi, w)))
    total = 0.0
    for combo in np.ndindex(*(len(w) for w in weights)):
        idx = tuple(weights[d][c][0] for d, c in enumerate(combo))
        wt = math.prod(weights[d][c][1] for d, c in enumerate(combo))
        total += wt * float(values[idx])
    return total, outside


# --------------------------------------------------------------------------- lookups


class Tables:
    """The parsed tables of one profile, with lookup methods and counters.

    ``counts[table] = [lookups, outside]``: how many lookups this object answered from
    each table and how many of those were outside the table's range (clamped). The cost
    model memoises per distinct shape, so these count distinct lookups.

    Args:
        tables: the ``tables`` mapping (validated here, :func:`validate_tables`).
    """

    def __init__(self, tables: Any) -> None:
        t = _plain(tables)
        validate_tables(t)
        self.header = {k: t[k] for k in _HEADER}
        self.counts: dict[str, list[int]] = {}
        self._matmul: dict[tuple[str, str], tuple[list, np.ndarray]] = {}
        groups: dict[tuple[str, str], dict] = {}
        for r in t.get("matmul", []):
            groups.setdefault((str(r["dtype"]), r["pass"]), {})[
                (r["m"], r["n"], r["k"])] = float(r["efficiency"])
        for key, pts in groups.items():
            axes = [sorted({p[d] for p in pts}) for d in range(3)]
            vals = np.empty(tuple(len(a) for a in axes))
            for (m, n, k), e in pts.items():
                vals[axes[0].index(m), axes[1].index(n), axes[2].index(k)] = e
            self._matmul[key] = (axes, vals)
        self._attention: dict[tuple, tuple[list, list]] = {}
        for r in t.get("attention", []):
            xs, ys = self._attention.setdefault(
                (str(r["dtype"]), r["pass"], int(r["head_dim"]), bool(r["causal"])), ([], []))
            xs.append(int(r["seq"]))
            ys.append(float(r["efficiency"]))
        mem = t.get("memory", [])
        self._memory = ([int(r["bytes"]) for r in mem], [float(r["bandwidth"]) * 1e9
                                                            for r in mem])
        self.launch_us = float(t["launch_us"]) if "launch_us" in t else None
        self._coll: dict[tuple[str, int, int], tuple[list, list]] = {}
        for c in t.get("collectives", []):
            self._coll[(c["kind"], int(c["per_node"]), int(c["nodes"]))] = (
                [int(r["size"]) for r in c["rows"]], [float(r["busbw"]) * 1e9 for r in c["rows"]])

    def _count(self, table: str, outside: bool) -> None:
        c = self.counts.setdefault(table, [0, 0])
        c[0] += 1
        c[1] += int(outside)

    def matmul_efficiency(self, dtype: str, phase: str, m: int, n: int, k: int) -> float | None:
        """Efficiency of an ``[m, k] x [k, n]`` matmul in ``dtype`` and pass ``phase``
        (``fwd`` / ``bwd``; a pass the table lacks falls back to the other), or None if
        the table has no entry for the dtype."""
        hit = self._matmul.get((dtype, phase)) or self._matmul.get(
            (dtype, "fwd" if phase == "bwd" else "bwd"))
        if hit is None:
            return None
        value, outside = interp_grid_log((m, n, k), *hit)
        self._count("matmul", outside)
        return value

    def attention_efficiency(self, dtype: str, phase: str, seq: int, head_dim: int,
                             causal: bool) -> float | None:
        """Efficiency of attention at sequence ``seq``: the line of this dtype, pass,
        causal mask and the nearest measured head dim (ties: the smaller), interpolated
        in log2 of the sequence length; None without a line for the dtype and mask."""
        dims = sorted({k[2] for k in self._attention
                       if k[0] == dtype and k[1] == phase and k[3] == causal})
        if not dims:
            return None
        near = min(dims, key=lambda d: (abs(math.log2(d) - math.log2(head_dim)), d))
        xs, ys = self._attention[(dtype, phase, near, causal)]
        value, outside = interp_log(seq, xs, ys)
        self._count("attention", outside or near != head_dim)
        return value

    def memory_bandwidth(self, nbytes: float) -> float | None:
        """Bandwidth (bytes/s) of a memory-bound kernel moving ``nbytes``; None without
        a memory table."""
        if not self._memory[0]:
            return None
        value, outside = interp_log(max(nbytes, 1.0), *self._memory)
        self._count("memory", outside)
        return value

    def collective_busbw(self, kind: str, per_node: int, nodes: int) -> tuple[list, list] | None:
        """``(sizes, busbw bytes/s)`` of the table of ``kind`` on a group of ``per_node``
        members on each of ``nodes`` nodes, or None (then the link model prices it)."""
        return self._coll.get((kind, per_node, nodes))

    def collective_layouts(self) -> list[tuple[str, int, int]]:
        """The ``(kind, per_node, nodes)`` of every collective table."""
        return sorted(self._coll)

    def count_collective(self, lookups: int, outside: int) -> None:
        """Add ``lookups`` collective-table lookups, ``outside`` of them off the table."""
        c = self.counts.setdefault("collectives", [0, 0])
        c[0] += int(lookups)
        c[1] += int(outside)

    def count_missing_layout(self) -> None:
        """Count a collective priced by the link model because the profile has no table
        for its kind and group layout."""
        c = self.counts.setdefault("collectives_by_constants", [0, 0])
        c[0] += 1
        c[1] += 1

    def record(self) -> dict[str, Any]:
        """What ``run.json`` reports: the profile's header and the lookup counters."""
        return {**{k: self.header[k] for k in ("date", "torch", "device", "measured")},
                "lookups": {k: {"lookups": v[0], "outside_table": v[1]}
                            for k, v in sorted(self.counts.items())}}
