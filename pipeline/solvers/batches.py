"""Level batches of an MRF's flat arrays (:class:`~pipeline.solvers.layout.MRFLayout`).

A *level* is a set of groups no two of which are adjacent, processed as one
batch of vectorised numpy calls (pipeline/solvers/layout.py explains why the
level-by-level sweep equals the sequential one). This module holds what one
batch reads -- :class:`SendBatch` (a TRW-S message pass) and :class:`CondBatch`
(a labelling sweep: decoding or ICM) -- how they are built from the compiled
arrays, the sweep that consumes a :class:`CondBatch` list, and the visiting
orders (:func:`index_order_levels`, :func:`interleaved_order`).

Gathers use the layouts of layout.py: messages in class space of their
target, values summed over incident edges in ``[group][label][edge]`` order with
``np.add.reduceat`` (fixed summation order, deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.solvers.layout import MRFLayout

_INF = np.inf
_IP = np.intp


@dataclass
class SendBatch:
    """One level of a TRW-S sweep (forward or backward).

    Attributes (``L`` = labels of the batch's groups, ``A`` = sum of source
    label counts over the sending edges, ``nE`` sending edges):
        nodes: intp ``[n]`` groups of the level (ascending).
        theta: float64 ``[L]`` concatenated unaries.
        th_idx: intp ``[sum K_s deg_s]`` gather of incoming messages from ``buf``.
        th_seg: intp ``[L]`` reduceat segment starts, or None if every degree is 1.
        gam_rep: float64 ``[A]`` gamma of the source group, per element.
        snd_rep: intp ``[A]`` index into the batch's ``theta_hat`` (labels
            sorted by source class within each sending edge).
        snd_rev: intp ``[A]`` index into ``buf`` of the reverse message.
        snd_seg: intp ``[sum R_src]`` class segment starts into ``A``.
        pair_src: intp ``[P]``, ``P = sum R_src D_dst``: index into the
            concatenated class minima ``hr`` for every (edge, target class,
            source class) triple, in that order.
        pair_tab: float64 ``[P]`` table value of the same triple.
        pair_seg: intp ``[sum D_dst]`` reduceat starts (one per target class).
        msg_seg: intp ``[nE]`` start of each edge's message in the batch output.
        msg_len: intp ``[nE]`` class count ``D_dst`` of each message.
        lo, hi: slice of ``buf`` receiving the batch's messages (compact).
        clo, chi: slice of the per-pass normalisation-constant vector.
        lab_start: intp ``[n]`` start of each group's labels in ``[L]``.
        coef: float64 ``[n]`` bound coefficient ``1 - n_in/n`` (backward only;
            None when all zero).
        forward: sweep direction; send_edges: intp ``[nE]`` edge ids sent along.
    """

    nodes: np.ndarray
    theta: np.ndarray
    th_idx: np.ndarray
    th_seg: np.ndarray | None
    lab_start: np.ndarray
    coef: np.ndarray | None
    forward: bool = True
    n_send: int = 0
    send_edges: np.ndarray | None = None
    gam_rep: np.ndarray | None = None
    snd_rep: np.ndarray | None = None
    snd_rev: np.ndarray | None = None
    snd_seg: np.ndarray | None = None
    pair_src: np.ndarray | None = None
    pair_tab: np.ndarray | None = None
    pair_seg: np.ndarray | None = None
    msg_seg: np.ndarray | None = None
    msg_len: np.ndarray | None = None
    lo: int = 0
    hi: int = 0
    clo: int = 0
    chi: int = 0
    big: list[tuple[int, int, int, np.ndarray]] | None = None
    small_pos: np.ndarray | None = None


#: A sending edge whose table has at least this many entries is minimised straight on
#: its table (:func:`big_edge_messages`), without the per-pair gather arrays.
BIG_TABLE = 1 << 12
#: Entries of the temporary ``hr + T`` of one big-edge minimisation (rows at a time).
BIG_CHUNK = 1 << 21


def big_edge_messages(batch: SendBatch, hr: np.ndarray, out: np.ndarray) -> None:
    """The messages of ``batch.big`` into ``out`` (the batch's ``[sum D_dst]`` output).

    Edge ``(seg, h_off, r, table)``: ``table`` is the ``[R, C]`` class table (a view of
    the compiled store), ``hr[h_off: h_off + r]`` the sender's class minima. Forward
    (rows send): ``mc(j) = min_i hr(i) + T(i, j)``; backward: ``mc(i) = min_j hr(j) +
    T(i, j)``. The same sums as the gathered ``hr[pair_src] + pair_tab`` of the small
    edges and the exact minimum of them (any order), so the messages are bit-identical;
    at most :data:`BIG_CHUNK` sums exist at a time.
    """
    for seg, h_off, r, table in batch.big:
        h = hr[h_off: h_off + r]
        n_rows, n_cols = table.shape
        step = max(1, BIG_CHUNK // n_cols)
        if batch.forward:  # h over rows; the message over columns
            dst = out[seg: seg + n_cols]
            for i in range(0, n_rows, step):
                part = (h[i: i + step, None] + table[i: i + step]).min(axis=0)
                if i == 0:
                    dst[...] = part
                else:
                    np.minimum(dst, part, out=dst)
        else:  # h over columns; the message over rows
            for i in range(0, n_rows, step):
                out[seg + i: seg + min(i + step, n_rows)] = (
                    h[None, :] + table[i: i + step]).min(axis=1)


@dataclass
class CondBatch:
    """One level of a sequential labelling sweep (decoding or ICM).

    The cost of label ``x`` of group ``s`` is
    ``theta_s(x) + sum_k buf[static[s, x, k] + mult_k * cls_flat[clsoff_k + labels[nbr_k]]]``
    over the incident edges ``k`` (``[group][label][edge]`` layout).

    Attributes:
        nodes: intp ``[n]``; theta: float64 ``[L]``; th_seg as in SendBatch.
        static: intp ``[sum K_s deg_s]`` static part of the ``buf`` index.
        p_nbr, p_clsoff, p_mult: intp ``[sum deg_s]`` per (group, edge) pair.
        p_of_elem: intp ``[sum K_s deg_s]`` pair of every element.
        lab_start: intp ``[n]``; pad_pos: intp ``[L]`` position in ``[n, Kmax]``
            (None when ``n == 1``); kmax: max domain size of the batch.
    """

    nodes: np.ndarray
    theta: np.ndarray
    th_seg: np.ndarray | None
    static: np.ndarray
    p_nbr: np.ndarray
    p_clsoff: np.ndarray
    p_mult: np.ndarray
    p_of_elem: np.ndarray
    lab_start: np.ndarray
    pad_pos: np.ndarray | None
    kmax: int


def _labels_of(cm: MRFLayout, nodes: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Concatenated unaries, ``th_seg`` and ``lab_start`` of the groups ``nodes``."""
    k = cm.sizes[nodes]
    lab_start = np.concatenate([[0], np.cumsum(k)[:-1]]).astype(_IP)
    theta = np.concatenate([cm.unary[s] for s in nodes])
    degs = np.array([len(cm.inc[s]) for s in nodes], dtype=_IP)
    if (degs == 1).all():
        th_seg = None
    else:
        elem_start = np.concatenate([[0], np.cumsum(k * degs)[:-1]])
        th_seg = np.concatenate(
            [elem_start[i] + np.arange(k[i]) * degs[i] for i in range(len(nodes))]
        ).astype(_IP)
    return theta, th_seg, lab_start


def send_batch(cm: MRFLayout, nodes: np.ndarray, send: list[int], th_idx_of: list,
               *, forward: bool) -> SendBatch:
    """The :class:`SendBatch` of one level: ``nodes`` send along the edges ``send``;
    ``th_idx_of[s]``: the message gather index of group ``s``."""
    theta, th_seg, lab_start = _labels_of(cm, nodes)
    th_idx = np.concatenate([th_idx_of[s] for s in nodes])
    n_send = len(send)
    coef = None
    if not forward:
        c = cm.coef[nodes]
        coef = c if (c > 0).any() else None
    if n_send == 0:
        return SendBatch(nodes, theta, th_idx, th_seg, lab_start, coef, forward)
    local = {int(s): i for i, s in enumerate(nodes)}
    src_n = np.array([len(cm.rcls[e]) if forward else len(cm.ccls[e]) for e in send])
    r_src = cm.R[send] if forward else cm.C[send]
    d_dst = cm.C[send] if forward else cm.R[send]
    reps, revs, segs, gams, ptab = [], [], [], [], []
    big_k = [k for k in range(n_send) if int(r_src[k]) * int(d_dst[k]) >= BIG_TABLE]
    small = np.ones(n_send, dtype=bool)
    small[big_k] = False
    a_off = 0
    for k, e in enumerate(send):
        u, v = int(cm.edges[e, 0]), int(cm.edges[e, 1])
        src = u if forward else v
        cls = cm.rcls[e] if forward else cm.ccls[e]
        rev_slot = cm.slot_b[e] if forward else cm.slot_f[e]
        t = cm.tables[e] if forward else cm.tables[e].T  # [source cls, target cls]
        order = np.argsort(cls, kind="stable")
        counts = np.bincount(cls, minlength=int(r_src[k]))
        reps.append(lab_start[local[src]] + order)
        revs.append(rev_slot + cls[order])
        segs.append(a_off + np.concatenate([[0], np.cumsum(counts)[:-1]]))
        gams.append(np.full(order.size, cm.gamma[src]))
        if small[k]:
            ptab.append(t.T.ravel())
        a_off += int(src_n[k])
    # pair_src: for edge k, the class-minimum indices h_off_k + (0..r_k-1), repeated d_k
    # times (small edges only; a big edge is minimised on its table).
    h_off_all = np.concatenate([[0], np.cumsum(r_src)[:-1]])
    r_s, d_s, h_off = r_src[small], d_dst[small], h_off_all[small]
    pair_len = np.repeat(r_s, d_s)
    block = r_s * d_s
    p_off = np.concatenate([[0], np.cumsum(block)[:-1]])[: block.size]
    within = np.arange(int(block.sum())) - np.repeat(p_off, block)
    pair_src = np.repeat(h_off, block) + within % np.repeat(r_s, block)
    msg_len = d_dst.astype(_IP)
    msg_seg = np.concatenate([[0], np.cumsum(msg_len)[:-1]]).astype(_IP, copy=False)
    big = small_pos = None
    if big_k:
        big = [(int(msg_seg[k]), int(h_off_all[k]), int(r_src[k]), cm.tables[send[k]])
               for k in big_k]
        small_pos = (np.concatenate([msg_seg[k] + np.arange(int(d_dst[k]))
                                     for k in np.flatnonzero(small)]).astype(_IP)
                     if small.any() else np.zeros(0, dtype=_IP))
    lo = int(cm.slot_f[send[0]] if forward else cm.slot_b[send[0]])
    cstart = int((cm.cpos_f if forward else cm.cpos_b)[send[0]])
    return SendBatch(
        nodes=nodes,
        theta=theta,
        th_idx=th_idx,
        th_seg=th_seg,
        gam_rep=np.concatenate(gams),
        snd_rep=np.concatenate(reps).astype(_IP, copy=False),
        snd_rev=np.concatenate(revs).astype(_IP, copy=False),
        snd_seg=np.concatenate(segs).astype(_IP, copy=False),
        pair_src=pair_src.astype(_IP, copy=False),
        pair_tab=np.concatenate(ptab) if ptab else np.zeros(0),
        pair_seg=np.concatenate([[0], np.cumsum(pair_len)[:-1]]).astype(_IP, copy=False),
        msg_seg=msg_seg,
        msg_len=msg_len,
        big=big,
        small_pos=small_pos,
        forward=forward,
        n_send=n_send,
        send_edges=np.array(send, dtype=_IP),
        lo=lo,
        hi=lo + int(msg_len.sum()),
        clo=cstart,
        chi=cstart + n_send,
        lab_start=lab_start,
        coef=coef,
    )


def cond_batch(cm: MRFLayout, nodes: np.ndarray, statics: list, *, decode: bool) -> CondBatch:
    """The :class:`CondBatch` of one level; ``statics[s]``: the static part of the
    cost gather of group ``s`` (decoding or ICM layout, ``decode``)."""
    theta, th_seg, lab_start = _labels_of(cm, nodes)
    static = np.concatenate([statics[s] for s in nodes])
    nbr, clsoff, mult = [], [], []
    for s in nodes:
        pn, pc, md, mi = cm.pairs[s]
        nbr.append(pn)
        clsoff.append(pc)
        mult.append(md if decode else mi)
    k = cm.sizes[nodes]
    # Pair of every element in the [group][label][edge] layout.
    degs = np.array([cm.pairs[s][0].size for s in nodes], dtype=_IP)
    block = k * degs
    e_off = np.concatenate([[0], np.cumsum(block)[:-1]])
    within = np.arange(int(block.sum())) - np.repeat(e_off, block)
    p_of = np.repeat(np.cumsum(degs) - degs, block) + within % np.repeat(degs, block)
    kmax = int(k.max())
    pad_pos = None
    if len(nodes) > 1:
        pad_pos = np.concatenate(
            [i * kmax + np.arange(k[i]) for i in range(len(nodes))]
        ).astype(_IP)
    return CondBatch(
        nodes=nodes,
        theta=theta,
        th_seg=th_seg,
        static=static,
        p_nbr=np.concatenate(nbr).astype(_IP, copy=False),
        p_clsoff=np.concatenate(clsoff).astype(_IP, copy=False),
        p_mult=np.concatenate(mult).astype(_IP, copy=False),
        p_of_elem=p_of.astype(_IP, copy=False),
        lab_start=lab_start,
        pad_pos=pad_pos,
        kmax=kmax,
    )


def conditional_sweep(
    cm: MRFLayout,
    buf: np.ndarray,
    labels: np.ndarray,
    batches: list[CondBatch],
    *,
    improve_only: bool,
    rtol: float = 1e-12,
) -> int:
    """Relabel every group in increasing order given its neighbours; return #changes.

    For each group ``s`` (level-batched, equal to the sequential sweep) the
    cost of label ``x`` is gathered per :class:`CondBatch` and ``labels[s]``
    is set to its argmin (first index on ties). With ``improve_only`` the
    label changes only if the new cost is lower than the current one by more
    than ``rtol * max(1, |new|)`` (ICM; guarantees termination).

    Args:
        cm: compiled problem; buf: its buffer (messages + tables).
        labels: int64 ``[G]``, updated in place.
        batches: ``cm.decode_batches`` (TRW-S decoding) or ``cm.icm_batches``.
    """
    changes = 0
    cls_flat = cm.cls_flat
    for b in batches:
        dyn = cls_flat[b.p_clsoff + labels[b.p_nbr]]
        dyn *= b.p_mult
        g = buf[b.static + dyn[b.p_of_elem]]
        cost = np.add.reduceat(g, b.th_seg) if b.th_seg is not None else g
        cost += b.theta
        if b.pad_pos is None:
            best = np.array([int(np.argmin(cost))])
            best_cost = cost[best]
        else:
            pad = np.full(len(b.nodes) * b.kmax, _INF)
            pad[b.pad_pos] = cost
            pad = pad.reshape(len(b.nodes), b.kmax)
            best = np.argmin(pad, axis=1)
            best_cost = pad[np.arange(len(b.nodes)), best]
        if improve_only:
            cur_cost = cost[b.lab_start + labels[b.nodes]]
            with np.errstate(invalid="ignore"):
                better = (cur_cost - best_cost) > rtol * np.maximum(1.0, np.abs(best_cost))
            if better.any():
                labels[b.nodes[better]] = best[better]
                changes += int(np.count_nonzero(better))
        else:
            changes += int(np.count_nonzero(labels[b.nodes] != best))
            labels[b.nodes] = best
    return changes


def index_order_levels(edges: np.ndarray, n: int) -> int:
    """Number of forward levels of the plain group order (longest increasing path + 1).

    O(E) Python loop over edges sorted by their higher endpoint.
    """
    if n == 0:
        return 0
    lev = [0] * n
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    for u, v in edges[np.argsort(edges[:, 1], kind="stable")].tolist():
        lev[v] = max(lev[v], lev[u] + 1)
    return max(lev) + 1


def interleaved_order(n: int, segments: int) -> np.ndarray:
    """Visit order that runs ``segments`` contiguous blocks of the group order side by side.

    Group ``s`` lies in block ``s // L`` at offset ``s % L`` (``L =
    ceil(n / segments)``); groups are visited by increasing (offset, block).
    Inside a block the group order is kept, so monotonic chains stay ``L``
    long, while one level now holds up to ``segments`` groups.

    Returns:
        int64 ``[n]``: ``order[i]`` is the ``i``-th group visited.
    """
    segments = max(1, min(int(segments), max(n, 1)))
    length = -(-n // segments)
    s = np.arange(n, dtype=np.int64)
    return np.lexsort((s // length, s % length)).astype(np.int64)
