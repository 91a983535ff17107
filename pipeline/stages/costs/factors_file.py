"""``factors.npz``: the complete MRF of eager costs (pipeline/core/artifacts.py
:data:`~pipeline.core.artifacts.FACTORS`), written by the costs stage and read back by the
solve stage bit for bit.

Layout: one NumPy archive of flat arrays, each list of vectors concatenated with its
offsets (``x_off[k]:x_off[k + 1]`` is entry k): ``domain`` and ``edges`` of the MRF,
``unary`` / ``unary_off`` per group, per group edge its factor's ``row`` / ``col``
classes and ``table`` (with ``table_shape``), ``constant``, and the constraint rows
(``lc_name``, ``lc_bounds`` ``[n, 2]`` (low, high), ``lc_group`` with ``lc_group_off``
per row, ``lc_coef`` with ``lc_coef_off`` per (row, group)); ``schema_version`` is the
artifact's version.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core import runtime
from pipeline.core.artifacts import FACTORS, check_schema
from pipeline.solvers.mrf import MRF, LinearConstraint, PairwiseFactor

__all__ = ["load_factors", "save_factors"]


def _cat(xs: list, dt: Any) -> np.ndarray:
    return np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)


def _offsets(sizes: list[int]) -> np.ndarray:
    return np.cumsum([0] + sizes)


def save_factors(path: Path | str, mrf: MRF, factors: list[PairwiseFactor]) -> None:
    """Write the complete MRF to ``factors.npz`` (atomically): every unary and pairwise
    factor (``factors``, in edge order) and the constraint rows
    (``mrf.linear_constraints``: each row's groups and coefficient vectors, in
    insertion order), with ``schema_version``."""
    uoff = _offsets([len(u) for u in mrf.unary])
    roff = _offsets([len(f.row_cls) for f in factors])
    coff = _offsets([len(f.col_cls) for f in factors])
    toff = _offsets([f.table.size for f in factors])
    tshape = np.array([f.table.shape for f in factors], dtype=np.int64).reshape(len(factors), 2)
    rows = list(mrf.linear_constraints)
    coefs = [np.asarray(c, dtype=np.float64) for r in rows for c in r.coef.values()]
    with runtime.atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, schema_version=np.array([FACTORS.schema_version]),
                     domain=mrf.domain_sizes, edges=mrf.edges,
                     unary=_cat(list(mrf.unary), np.float64), unary_off=uoff,
                     row=_cat([f.row_cls for f in factors], np.int32), row_off=roff,
                     col=_cat([f.col_cls for f in factors], np.int32), col_off=coff,
                     table=_cat([f.table.ravel() for f in factors], np.float64),
                     table_off=toff, table_shape=tshape, constant=np.array([mrf.constant]),
                     lc_name=np.array([r.name for r in rows], dtype=str),
                     lc_bounds=np.array([[r.low, r.high] for r in rows],
                                        dtype=np.float64).reshape(len(rows), 2),
                     lc_group=np.array([g for r in rows for g in r.coef], dtype=np.int64),
                     lc_group_off=_offsets([len(r.coef) for r in rows]),
                     lc_coef=_cat(coefs, np.float64),
                     lc_coef_off=_offsets([len(c) for c in coefs]))


def load_factors(path: Path | str) -> MRF:
    """Read ``factors.npz`` back into an eager MRF, rows included (bit-identical values).

    Raises:
        PlanError: the archive has another schema version (written by other code).
    """
    with np.load(path) as npz:  # NpzFile re-reads (and copies) an array on every z[key]
        z = {k: npz[k] for k in npz.files}
    version = int(z["schema_version"][0]) if "schema_version" in z else None
    check_schema(FACTORS, version, path)
    uoff, roff, coff, toff = z["unary_off"], z["row_off"], z["col_off"], z["table_off"]
    unary = [z["unary"][uoff[g]:uoff[g + 1]] for g in range(len(uoff) - 1)]
    factors = []
    for e in range(len(roff) - 1):
        shape = tuple(z["table_shape"][e])
        factors.append(PairwiseFactor(z["row"][roff[e]:roff[e + 1]],
                                      z["col"][coff[e]:coff[e + 1]],
                                      z["table"][toff[e]:toff[e + 1]].reshape(shape)))
    rows = []
    group_off, coef_off = z["lc_group_off"], z["lc_coef_off"]
    for i, name in enumerate(z["lc_name"].tolist()):
        coef = {}
        for k in range(int(group_off[i]), int(group_off[i + 1])):
            coef[int(z["lc_group"][k])] = z["lc_coef"][coef_off[k]:coef_off[k + 1]].copy()
        low, high = z["lc_bounds"][i]
        rows.append(LinearConstraint(str(name), coef, float(low), float(high)))
    return MRF(domain_sizes=z["domain"], unary=unary, edges=z["edges"],
               factor=factors.__getitem__, constant=float(z["constant"][0]),
               linear_constraints=rows)
