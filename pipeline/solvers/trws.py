r"""Sequential tree-reweighted message passing (TRW-S) for the pairwise MRF.

Source: V. Kolmogorov, "Convergent Tree-Reweighted Message Passing for Energy
Minimization", IEEE TPAMI 28(10), 2006 (below "[K06]"), and its reference
implementation (MRFEnergy, ``minimize.cpp``: ``Minimize_TRW_S`` for the
passes and the bound, ``ComputeSolutionAndEnergy`` for the labelling). The
derivation of the bound below is self-contained so it can be checked here.

Problem ([K06] eq. (1); :mod:`pipeline.solvers.mrf`)::

    E(x) = const + sum_s theta_s(x_s) + sum_{(s,t) in E} theta_st(x_s, x_t)

with ``theta_st(x_s, x_t) = T_e[row_cls(x_s), col_cls(x_t)]`` (class form)
and ``+inf`` marking forbidden labels / pairs.

Order and weights
-----------------
Groups are visited in a fixed order; below, ``t < s`` means "``t`` comes
before ``s`` in that order". The order is the group index order, or (default
for long chain-like graphs, see ``order`` in :func:`solve_trws`) the group
order cut into contiguous segments that are swept side by side
(:func:`~pipeline.solvers.batches.interleaved_order`): TRW-S is valid and
monotone for any fixed order ([K06] Sec. 4), and the interleaved one needs
far fewer numpy batches per sweep. For group ``s`` let
``n_in(s) = |{t < s : (t, s) in E}|``, ``n_out(s) = |{t > s : (s, t) in E}|``
and ``n_s = max(n_in(s), n_out(s))``. Pairing each incoming with an outgoing
edge splits the graph into *monotonic chains* (increasing group index) that
cover every edge exactly once; ``n_s`` chains pass through ``s`` and
``n_s - n_in(s)`` of them start at ``s``. Every chain through ``s`` receives
the share ``gamma_s theta_s`` of the unary, with ([K06] Sec. 4, the TRW-S
algorithm, ``gamma_st = rho_st / rho_s``; MRFEnergy ``SetMonotonicTrees``)::

    gamma_s = 1 / max(n_in(s), n_out(s)).

Messages
--------
``M_ts`` is the message from ``t`` into ``s``; the reparametrised unary is
``theta_hat_s = theta_s + sum_{t in N(s)} M_ts``. Visiting ``s`` in the forward
pass updates, for every later neighbour ``t > s`` ([K06] TRW-S algorithm)::

    M_st(x_t) = min_{x_s} [ gamma_s theta_hat_s(x_s) - M_ts(x_s) + theta_st(x_s, x_t) ] - c_st

where ``c_st`` is the minimum over ``x_t`` of the bracket (normalisation).
The backward pass (decreasing index) does the same towards earlier
neighbours. In class form the inner minimum is computed in three steps,
never building a ``K_s x K_t`` matrix::

    h(x_s)   = gamma_s theta_hat_s(x_s) - M_ts(x_s)                  [K_s]
    hr(i)    = min_{x_s : cls_s(x_s) = i} h(x_s)                      [R]
    mc(j)    = min_i hr(i) + T(i, j)                                  [C]
    M_st(x_t) = mc(cls_t(x_t)) - min_j mc(j)

so messages are stored in the class space of their target (``C`` values).

``+inf`` handling. A label with ``theta_hat_s(x) = +inf`` is *dead*: by
induction it belongs to no finite-energy labelling (a message entry is
``+inf`` only if no live label of the sender is compatible). Dead labels get
``h = +inf`` (never ``inf - inf``: the reverse message is subtracted only
where it is finite, and it is infinite only where ``theta_hat_s`` already is).
No ``-inf`` ever appears, so no NaN either. If a whole message is ``+inf``
(``c_st = +inf``) no label of ``t`` survives and :class:`InfeasibleError` is
raised.

Lower bound
-----------
Let ``theta_bar`` be the reparametrisation defined by the messages at the end
of a backward pass: ``theta_bar_s = theta_hat_s`` and ``theta_bar_st =
theta_st - M_ts - M_st``, so ``E(x) = const + sum_s theta_bar_s(x_s) + sum_st
theta_bar_st(x_s, x_t)`` for every ``x``. Give each chain ``T`` the energy
``E_T = sum_{s in T} gamma_s theta_bar_s + sum_{(s,t) in T} theta_bar_st``;
then ``E = const + sum_T E_T`` and ``min E >= const + sum_T min E_T``
(the TRW bound, [K06] Sec. 2, after Wainwright et al.). Minimising a chain by
dynamic programming from its last group shows, because the backward message
``M_ts`` was computed from exactly this ``theta_bar_s`` and ``M_st``, that the
tail of the chain collapses edge by edge into the constants ``c_ts``::

    min E_T = sum_{(s,t) in T, s<t} c_ts  +  gamma_first(T) * min_x theta_bar_first(T)(x)

Summing over chains (``n_s - n_in(s)`` chains start at ``s``) gives the bound
computed during the backward pass::

    LB = const + sum_{(s,t), s<t} c_ts + sum_s (1 - n_in(s) gamma_s) min_x theta_hat_s(x)

This is what MRFEnergy computes (it subtracts ``min theta_hat_s`` from
``theta_hat_s`` before sending with weight ``gamma_s``, which moves
``n_in(s) gamma_s min theta_hat_s`` from the node term into the message
constants). [K06] proves that TRW-S never decreases this bound; isolated
groups contribute ``min theta_s`` exactly.

Labelling
---------
After each backward pass, groups are labelled in increasing order
(``ComputeSolutionAndEnergy``; [K06] Sec. 4 assigns labels during the next
forward pass, with the same messages)::

    x_s = argmin_x theta_s(x) + sum_{t<s} theta_ts(x_t, x) + sum_{t>s} M_ts(x)

The best-energy labelling over all iterations is kept, then polished by
:func:`pipeline.solvers.local_search.coordinate_descent`.

Linear constraints (``MRF.linear_constraints``) are ignored here: the
Lagrangian wrapper (:mod:`pipeline.solvers.lagrangian`) handles them (folding
multiplier-weighted coefficients into the unaries and calling this solver
repeatedly).

Implementation: :class:`pipeline.solvers.compiled.CompiledMRF` schedules the
groups in levels so that one level is one batch of numpy calls and the result
equals the sequential sweep exactly.
"""

from __future__ import annotations

import time

import numpy as np

from pipeline.solvers.batches import (
    SendBatch,
    big_edge_messages,
    conditional_sweep,
    index_order_levels,
    interleaved_order,
)
from pipeline.solvers.compiled import CompiledMRF
from pipeline.solvers.errors import InfeasibleError, NoFeasibleLabelingError
from pipeline.solvers.local_search import coordinate_descent
from pipeline.solvers.mrf import MRF
from pipeline.solvers.options import TrwsOptions, TrwsProgressFn
from pipeline.solvers.result import CERTIFY_RTOL, SolverResult, certified_status, is_certified
from pipeline.solvers.warm import WarmStart

_INF = np.inf

ProgressFn = TrwsProgressFn


def _send_pass(
    cm: CompiledMRF,
    buf: np.ndarray,
    batches: list[SendBatch],
    consts: np.ndarray,
    node_part: list[float] | None,
) -> None:
    """One TRW-S sweep over ``batches`` (forward or backward), updating ``buf`` in place.

    Writes the normalisation constant of every sent message into ``consts``;
    when ``node_part`` is a list, appends ``sum_s coef_s min theta_hat_s`` per
    batch (backward pass bound terms).

    Raises:
        InfeasibleError: a message (or a reparametrised unary) is ``+inf``
            for every label.
    """
    for b in batches:
        g = buf[b.th_idx]
        th = np.add.reduceat(g, b.th_seg) if b.th_seg is not None else g
        th += b.theta  # theta_hat of every label of the batch, [L]
        if node_part is not None and b.coef is not None:
            mins = np.minimum.reduceat(th, b.lab_start)
            if mins.max() == _INF:
                s = int(cm.order[b.nodes[int(np.argmax(mins))]])
                raise InfeasibleError(
                    f"TRW-S: every label of group {s} is ruled out by forbidden (+inf) "
                    "entries: no labelling of finite energy exists"
                )
            node_part.append(float(np.dot(b.coef, mins)))
        if b.n_send == 0:
            continue
        a = th[b.snd_rep]
        a *= b.gam_rep
        m = buf[b.snd_rev]
        np.subtract(a, m, out=a, where=m != _INF)
        hr = np.minimum.reduceat(a, b.snd_seg)  # class minima, [sum R_src]
        if b.big is None:
            mc = np.minimum.reduceat(hr[b.pair_src] + b.pair_tab, b.pair_seg)  # [sum D_dst]
        else:  # big tables minimised in place (batches.big_edge_messages), same values
            mc = np.empty(b.hi - b.lo)
            if b.small_pos.size:
                mc[b.small_pos] = np.minimum.reduceat(hr[b.pair_src] + b.pair_tab,
                                                      b.pair_seg)
            big_edge_messages(b, hr, mc)
        c = np.minimum.reduceat(mc, b.msg_seg)  # normalisation constant per message
        if c.max() == _INF:
            e = int(b.send_edges[int(np.argmax(c))])
            u, v = (int(cm.order[x]) for x in cm.edges[e])
            src, dst = (u, v) if b.forward else (v, u)
            raise InfeasibleError(
                f"TRW-S: edge {e} ({min(u, v)}, {max(u, v)}): no label of group {dst} is "
                f"compatible with a still-allowed label of group {src} (forbidden +inf "
                "entries): no labelling of finite energy exists"
            )
        mc -= np.repeat(c, b.msg_len)
        buf[b.lo : b.hi] = mc
        consts[b.clo : b.chi] = c


def _resolve_order(
    mrf: MRF, order: str | np.ndarray, max_levels: int
) -> tuple[np.ndarray | None, str]:
    """Turn the ``order`` argument of :func:`solve_trws` into a permutation (None = identity)."""
    n = mrf.num_groups
    if isinstance(order, str):
        if order == "index":
            return None, "index"
        if order == "auto":
            if max_levels < 1:
                raise ValueError(f"max_levels must be >= 1, got {max_levels}")
            if index_order_levels(mrf.edges, n) <= max_levels:
                return None, "index"
            segments = -(-n // max_levels)
            return interleaved_order(n, segments), f"interleaved({segments})"
        raise ValueError(f"order must be 'auto', 'index' or a permutation, got {order!r}")
    return np.asarray(order, dtype=np.int64), "custom"


def solve_trws(
    mrf: MRF,
    *,
    max_iters: int = 500,
    tol: float = 1e-7,
    local_search_rounds: int = 50,
    time_limit_s: float | None = None,
    progress: ProgressFn | None = None,
    order: str | np.ndarray = "auto",
    max_levels: int = 128,
    label_bounds: bool = False,
    warm: WarmStart | None = None,
) -> SolverResult:
    """Minimise ``E`` with TRW-S, then polish the best labelling by local search.

    Args:
        mrf: the problem (``linear_constraints`` are ignored, see module doc).
        max_iters: cap on TRW-S iterations (one forward + one backward pass
            + one decoding each); deterministic.
        tol: stop when the bound improves by less than
            ``tol * max(1, |bound|)`` over one iteration.
        local_search_rounds: cap on coordinate-descent rounds after TRW-S
            (0 disables the polish).
        time_limit_s: optional wall-clock safety net in seconds, checked after
            every iteration; ``None`` (default) = off, since it breaks
            determinism.
        progress: optional ``progress(iteration, bound_us, best_energy_us)``
            called after every iteration.
        order: visiting order of the groups: ``"index"`` (group order),
            ``"auto"`` (group order if it has at most ``max_levels`` levels,
            else :func:`~pipeline.solvers.batches.interleaved_order` with
            ``ceil(G / max_levels)`` segments), or an explicit permutation
            (``order[i]`` = ``i``-th group visited). Any fixed order is a valid
            TRW-S schedule (monotone bound); it changes the chains, hence the
            trajectory, and the speed (one level = one batch of numpy calls).
        max_levels: level budget of ``order="auto"``.
        label_bounds: also return ``result.label_bounds``: per group and label a
            lower bound on ``E`` over labellings using that label, from the final
            messages (:func:`pipeline.solvers.pruning.label_bounds`); one extra
            pass over the tables.
        warm: optional :class:`~pipeline.solvers.warm.WarmStart`: start from the
            messages it holds when they were saved from a solve of the same layout
            (any messages give a valid bound: pipeline/solvers/warm.py), and leave
            this solve's final messages in it.

    Returns:
        :class:`SolverResult` with ``lower_bound_source="trws"`` and status
        ``"Optimal"`` iff the bound certifies the objective within
        ``1e-9 * max(1, |objective|)``, else ``"Heuristic"``. ``extra`` holds
        ``stop_reason`` (``certified``/``converged``/``max_iters``/
        ``time_limit``/``no_edges``), ``energy_trws`` (best decoded energy
        before the polish), ``best_iteration``, ``order``, ``levels`` (numpy
        batches per sweep), ``compile_seconds``, ``local_search_seconds``,
        ``warm_start`` (the messages started from ``warm``'s).

    Raises:
        ValueError: malformed MRF or arguments.
        InfeasibleError: the problem provably has no finite-energy labelling.
        NoFeasibleLabelingError: no finite-energy labelling was found (the
            problem may still be feasible; try the exact ILP).
    """
    if max_iters < 1:
        raise ValueError(f"max_iters must be >= 1, got {max_iters}")
    if not tol >= 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    t0 = time.perf_counter()
    perm, order_name = _resolve_order(mrf, order, max_levels)
    cm = CompiledMRF(mrf, perm)
    t_compiled = time.perf_counter()
    n = cm.num_groups
    labels = np.zeros(n, dtype=np.int64)
    labels[cm.isolated] = cm.isolated_labels()
    iso_min = float(sum(float(cm.unary[s].min()) for s in cm.isolated))
    buf = cm.new_buffer()
    warmed = warm is not None and cm.num_edges > 0 and warm.load(cm, buf)
    history: list[float] = []
    best_labels = labels.copy()
    best_energy = _INF
    best_iter = 0
    stop = "max_iters"
    it = 0
    if cm.num_edges == 0:
        lb = cm.constant + iso_min
        history.append(lb)
        best_energy = cm.energy(labels)
        stop = "no_edges"
    else:
        consts_f = np.zeros(cm.num_edges)
        consts_b = np.zeros(cm.num_edges)
        for it in range(1, max_iters + 1):
            _send_pass(cm, buf, cm.fwd_batches, consts_f, None)
            node_part: list[float] = []
            _send_pass(cm, buf, cm.bwd_batches, consts_b, node_part)
            lb = cm.constant + iso_min + float(consts_b.sum()) + float(np.sum(node_part))
            history.append(lb)
            conditional_sweep(cm, buf, labels, cm.decode_batches, improve_only=False)
            energy = cm.energy(labels)
            if energy < best_energy:
                best_energy, best_labels, best_iter = energy, labels.copy(), it
            if progress is not None:
                progress(it, lb, best_energy)
            if is_certified(best_energy, max(history), CERTIFY_RTOL):
                stop = "certified"
                break
            if it > 1 and history[-1] - history[-2] < tol * max(1.0, abs(history[-1])):
                stop = "converged"
                break
            if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
                stop = "time_limit"
                break
    energy_trws = best_energy
    if warm is not None and cm.num_edges:
        warm.save(cm, buf)
    bounds = _label_bounds(cm, buf) if label_bounds else None
    labels = cm.to_external(best_labels)
    t_polish = time.perf_counter()
    if local_search_rounds > 0 and cm.num_edges:
        labels = coordinate_descent(mrf, labels, local_search_rounds, compiled=cm, buf=buf)
    t_polished = time.perf_counter()
    objective = mrf.evaluate(labels)
    if not np.isfinite(objective):
        raise NoFeasibleLabelingError(
            "TRW-S and local search found no labelling of finite energy; the problem may be "
            "infeasible (TRW-S did not prove it): try the exact ILP solver"
        )
    lower_bound = max(history)
    status = certified_status(objective, lower_bound)
    return SolverResult(
        labels=labels,
        objective=objective,
        lower_bound=lower_bound,
        lower_bound_source="trws",
        status=status,
        iterations=it,
        bound_history=history,
        solve_seconds=time.perf_counter() - t0,
        extra={
            "stop_reason": stop,
            "energy_trws": float(energy_trws),
            "best_iteration": best_iter,
            "order": order_name,
            "levels": {"forward": len(cm.fwd_batches), "backward": len(cm.bwd_batches)},
            "compile_seconds": t_compiled - t0,
            "local_search_seconds": t_polished - t_polish,
            "warm_start": bool(warmed),
        },
        label_bounds=bounds,
    )


def solve(mrf: MRF, options: TrwsOptions | None = None) -> SolverResult:
    """The solver protocol (:mod:`pipeline.solvers.registry`): :func:`solve_trws`
    with the fields of ``options`` (defaults when None)."""
    o = options if options is not None else TrwsOptions()
    return solve_trws(mrf, max_iters=o.max_iters, tol=o.tol,
                      local_search_rounds=o.local_search_rounds, time_limit_s=o.time_limit_s,
                      progress=o.progress, order=o.order, max_levels=o.max_levels,
                      label_bounds=o.label_bounds, warm=o.warm)


def _label_bounds(cm: CompiledMRF, buf: np.ndarray) -> list[np.ndarray]:
    """Per-label lower bounds (external group order) from the current messages.

    The forward message of edge ``e`` (into ``v``, ``C_e`` values) and its backward
    message (into ``u``, ``R_e`` values) are the reparametrisation vectors of
    :func:`pipeline.solvers.pruning.label_bounds`; with all-zero messages (no
    edges, or before any pass) the bounds are those of the plain energy.
    """
    from pipeline.solvers.pruning import label_bounds

    n_edges = cm.num_edges
    row = [buf[cm.slot_b[e]: cm.slot_b[e] + cm.R[e]] for e in range(n_edges)]
    col = [buf[cm.slot_f[e]: cm.slot_f[e] + cm.C[e]] for e in range(n_edges)]
    internal = label_bounds(cm.unary, cm.edges, cm.rcls, cm.ccls, cm.tables, row, col,
                            cm.constant)
    out: list[np.ndarray] = [np.zeros(0)] * cm.num_groups
    for s_int, b in enumerate(internal):
        out[int(cm.order[s_int])] = b
    return out
