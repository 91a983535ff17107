"""Roofline compute cost of one op on one device, in µs.

Roofline model (Williams, Waterman & Patterson 2009, "Roofline: an insightful visual
performance model for multicore architectures", CACM 52(4)): a kernel is bound either by
arithmetic or by memory traffic, so its time is

    t = max(FLOPs / (peak_flops * compute_efficiency),
            bytes / (hbm_bandwidth * memory_efficiency)) * 1e6      [µs]

floored at ``hw.kernel_floor_us`` for every real kernel (launch + tail latency), and
0 for view / metadata ops, which launch no kernel.

FLOPs come from PyTorch's own formulas (:data:`torch.utils.flop_counter.flop_registry`:
mm, addmm, bmm, baddbmm, convolution(+backward), the SDPA flash / efficient / cudnn
forward and backward ops, ...), evaluated on the *local* (per-device, sharded) shapes.
Ops without a formula count 0 FLOPs: they are memory-bound.

Causal attention. PyTorch's SDPA formulas count the full ``S_q x S_k`` score and
``P V`` products whatever the mask; a causal kernel (FlashAttention, Dao et al. 2022,
and FlashAttention-2, Dao 2023, §3.1.1: blocks above the diagonal are skipped) computes
only the query-key pairs the mask keeps. With ``T`` keys, causal attention keeps
``T (T + 1) / 2`` of the ``T^2`` pairs, so an attention op with ``is_causal=True``
counts :func:`causal_fraction` ``= (T + 1) / (2 T)`` of the formula's FLOPs, forward
and backward (every FLOP of those formulas is a score or ``P V`` product). With
``S_q = S_k = T`` this is exact for the pairs (top-left alignment, the only case of a
training step); with ``S_q < S_k`` (a context-parallel chunk of queries against all
keys, pipeline/stages/topology/extra_strategies.py) it is the rank's ``1/n`` share of
the causal work under the load-balanced sequence order that module assumes. A tiled
kernel also computes the masked half of each diagonal tile: ``T (T + B) / 2`` pairs for
tiles of ``B`` rows, ``(B - 1) / (2 T)`` more (0.8 % at ``T = 8192``, ``B = 128``),
not counted (an approximation).
PyTorch has no formula for ``aten._grouped_mm`` (MoE experts): :func:`grouped_mm_flops`
gives it (:data:`_FLOP_FORMULAS`, consulted before torch's registry).

The peak is chosen by dtype: bf16 / fp16 (and fp8) use ``peak_flops_bf16``, all other
dtypes ``peak_flops_fp32``.

Measured tables (:func:`table_rates`): where the hardware config carries a profile
(:mod:`pipeline.costmodel.profile`), a matmul (``mm``, ``addmm``, ``bmm``, ``baddbmm``)
takes the profile's efficiency at its ``(M, N, K)`` (a batched matmul's batch folded into
``M``) for its dtype and pass (the node's phase), an SDPA op the efficiency at its
sequence length, head dim and causal mask (pass from the op: ``*_backward`` is bwd), and
every op's memory term the measured bandwidth at its byte count; everything else the
constants.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import flop_registry

from pipeline.core.ir import resolve_op
from pipeline.costmodel.hardware import tables_of
from pipeline.dtensor.torch_compat import HigherOrderOperator, OpOverload, op_schema

__all__ = [
    "causal_fraction",
    "grouped_mm_flops",
    "is_view_op",
    "op_flops",
    "peak_flops",
    "resolve_op",
    "roofline_us",
    "table_rates",
]

aten = torch.ops.aten

#: Ops that launch no kernel although their schema does not say they alias:
#: ``_unsafe_view`` is ``view`` without the alias annotation (its input is a fresh,
#: otherwise unused tensor), and the ``empty`` factories only allocate.
_NO_KERNEL_PACKETS = frozenset(
    {
        aten._unsafe_view,
        aten.empty,
        aten.empty_like,
        aten.empty_strided,
        aten.new_empty,
        aten.new_empty_strided,
    }
)

_HALF_DTYPES = frozenset(
    {
        torch.bfloat16,
        torch.float16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    }
)


@functools.lru_cache(maxsize=8192)
def _is_view_overload(op: OpOverload) -> bool:
    if op.overloadpacket in _NO_KERNEL_PACKETS:
        return True
    tags = set(op.tags)
    if torch.Tag.inplace_view in tags:  # t_, unsqueeze_, as_strided_: metadata-only writes
        return True
    schema = op_schema(op)
    returns = schema.returns
    if not any("Tensor" in str(r.type) for r in returns):
        # sym_size, sym_numel, ...: metadata. Mutating ops without a tensor result
        # (_foreach_add_, ...) do real work.
        return not schema.is_mutable
    first = returns[0].alias_info
    return first is not None and not first.is_write


def is_view_op(op: Any) -> bool:
    """Whether ``op`` is a view / metadata op that launches no kernel (cost 0).

    Decided from the op schema rather than a hand list: an op whose first return
    aliases an input without writing it (``returns[0].alias_info`` not None and not a
    write, e.g. ``view``, ``reshape``, ``t``, ``transpose``, ``permute``, ``expand``,
    ``unsqueeze``, ``squeeze``, ``slice``, ``select``, ``alias``, ``detach``,
    ``as_strided``, ``split``, ``unbind``) is a view; so is an op tagged
    ``torch.Tag.inplace_view`` and an op with no tensor output (``sym_size``).
    ``aten._unsafe_view`` (a view without the annotation) and the ``empty``
    factories (allocation only) are listed explicitly. Python callables such as
    ``operator.getitem`` (tuple element selection in FX graphs) are metadata too;
    higher-order operators are not.

    Args:
        op: ``OpOverload``, ``OpOverloadPacket``, op name string, or an FX target.
    """
    op = resolve_op(op)
    if isinstance(op, OpOverload):
        return _is_view_overload(op)
    if isinstance(op, HigherOrderOperator):
        return False
    return op is operator.getitem or callable(op)


def _packet(op: Any) -> Any:
    op = resolve_op(op)
    if isinstance(op, OpOverload):
        return op.overloadpacket
    return op


def _freeze(x: Any) -> Any:
    if isinstance(x, torch.Tensor) or (hasattr(x, "shape") and not isinstance(x, np.ndarray)):
        return torch.Size(x.shape)  # tensors, TensorMeta (a NamedTuple!) -> their shape
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    return x


def _as_shape(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.shape
    if hasattr(x, "shape") and not isinstance(x, np.ndarray):
        return torch.Size(x.shape)  # TensorMeta and friends
    return x


def _meta_tensor(shape: Any) -> Any:
    if shape is None or isinstance(shape, torch.Tensor):
        return shape
    if isinstance(shape, (list, tuple)) and all(isinstance(s, int) for s in shape):
        return torch.empty(tuple(shape), device="meta")
    return shape


def _is_tensor_arg(arg: Any) -> bool:
    return arg is not None and str(arg.type) in ("Tensor", "Optional[Tensor]")


def _raw_args(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list, dict]:
    """For 'raw' flop formulas (which want tensors): shapes at Tensor schema slots -> meta."""
    if not isinstance(op, OpOverload):
        return [_meta_tensor(a) for a in args], dict(kwargs)
    schema_args = op_schema(op).arguments
    new_args = [
        _meta_tensor(a) if i < len(schema_args) and _is_tensor_arg(schema_args[i]) else a
        for i, a in enumerate(args)
    ]
    by_name = {a.name: a for a in schema_args}
    new_kwargs = {
        k: _meta_tensor(v) if _is_tensor_arg(by_name.get(k)) else v for k, v in kwargs.items()
    }
    return new_args, new_kwargs


def grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_val: Any = None,
                     **kwargs: Any) -> int:
    """FLOPs of ``aten._grouped_mm(a, b, offs)``: ``2 * M * K * N`` summed over the groups.

    The four layouts (``offs`` splits the dim of total size marked ``_total``):

    * 2-d x 3-d: ``a [M_total, K]``, ``b [G, K, N]`` -> ``[M_total, N]``: ``2 M_total K N``
      (each row of ``a`` times its group's matrix: the MoE forward / input gradient);
    * 3-d x 2-d: ``a [G, M, K]``, ``b [K, N_total]`` -> ``[M, N_total]``: ``2 M K N_total``;
    * 2-d x 2-d: ``a [M, K_total]``, ``b [K_total, N]`` -> ``[G, M, N]``: ``2 M K_total N``
      (the expert-weight gradient);
    * 3-d x 3-d: ``a [G, M, K]``, ``b [G, K, N]`` -> ``[G, M, N]``: ``2 G M K N``.
    """
    a, b = tuple(a_shape), tuple(b_shape)
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 2:
        return 2 * a[1] * a[2] * b[1]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    raise ValueError(f"_grouped_mm of shapes {list(a)} x {list(b)}: expected 2-d or 3-d operands")


#: FLOP formulas of ops PyTorch's registry lacks; each takes the argument *shapes* like a
#: ``shape_wrapper``'d formula of torch's registry.
_FLOP_FORMULAS: dict[Any, Any] = {aten._grouped_mm: grouped_mm_flops}


#: Attention ops whose FLOPs :func:`causal_fraction` scales when ``is_causal`` is set
#: (q, k, v laid out ``[B, H, S, D]``: the keys are ``key.shape[-2]``). The kernels
#: below them (``_flash_attention_forward``, ``_efficient_attention_forward``), which
#: the traces never hold (they keep the SDPA op), keep PyTorch's unmasked count.
_CAUSAL_OPS = frozenset({
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_cudnn_attention_backward,
})


def causal_fraction(keys: int) -> float:
    """Fraction of an attention op's score / ``P V`` FLOPs a causal mask keeps:
    ``T (T + 1) / 2`` of ``T^2`` query-key pairs, ``(T + 1) / (2 T)`` with ``T = keys``
    (module docstring: exact for ``S_q = S_k``; the load-balanced share of a
    context-parallel query chunk otherwise).

    Example: ``causal_fraction(8192) = 8193 / 16384 = 0.50006``.
    """
    if keys < 1:
        raise ValueError(f"causal attention over {keys} keys: need at least 1")
    return (keys + 1) / (2 * keys)


def _causal_keys(op: Any, args: Sequence[Any], kwargs: dict) -> int | None:
    """The key length of a causal attention op (``is_causal`` true), else None."""
    op = resolve_op(op)
    if not isinstance(op, OpOverload):
        return None
    if op.overloadpacket not in _CAUSAL_OPS:
        return None
    names = [a.name for a in op_schema(op).arguments]
    given = dict(zip(names, args)) | dict(kwargs)  # an omitted is_causal is False
    if not given.get("is_causal"):
        return None
    return int(tuple(_as_shape(given["key"]))[-2])


def _eval_flops(op: Any, args: tuple, kwargs: dict, out_shape: Any) -> float:
    own = _FLOP_FORMULAS.get(_packet(op))
    formula = own or flop_registry.get(_packet(op))
    if formula is None:
        return 0.0
    keys = _causal_keys(op, args, kwargs)
    if keys is not None:
        return _eval_formula(op, own, formula, args, kwargs, out_shape) * causal_fraction(keys)
    return _eval_formula(op, own, formula, args, kwargs, out_shape)


def _eval_formula(op: Any, own: Any, formula: Any, args: tuple, kwargs: dict,
                  out_shape: Any) -> float:
    args = [_as_shape(a) for a in args]
    kwargs = {k: _as_shape(v) for k, v in kwargs.items()}
    if own is not None:
        return float(own(*args, out_val=out_shape, **kwargs))
    if hasattr(formula, "__wrapped__"):  # shape_wrapper'd formula: shapes are fine
        return float(formula(*args, out_val=out_shape, **kwargs))
    raw_args, raw_kwargs = _raw_args(resolve_op(op), args, kwargs)
    return float(formula(*raw_args, out_val=out_shape, **raw_kwargs))


@functools.lru_cache(maxsize=1 << 16)
def _eval_flops_cached(op: Any, args: tuple, kwargs: tuple, out_shape: Any) -> float:
    return _eval_flops(op, args, dict(kwargs), out_shape)


def op_flops(
    op: Any,
    arg_shapes: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    out_shape: Any = None,
) -> float:
    """FLOPs of ``op`` on one device, from PyTorch's flop formulas on local shapes.

    Args:
        op: ``OpOverload`` / packet / name string (``"aten.mm.default"``).
        arg_shapes: the op's positional arguments with every tensor replaced by its
            *local* shape (a ``torch.Size``, tuple or list of ints; a tensor or a
            ``TensorMeta`` is also accepted); non-tensor arguments as they are.
        kwargs: keyword arguments, tensors likewise replaced by shapes.
        out_shape: local output shape (a tuple of shapes for multi-output ops), or None.

    Returns:
        FLOPs (float); 0.0 for ops without a formula (memory-bound ops). A causal
        attention op (``is_causal=True``) counts :func:`causal_fraction` of PyTorch's
        formula.

    Example:
        ``op_flops(aten.mm.default, [(4096, 4096), (4096, 4096)])`` is
        ``2 * 4096**3 = 1.374e11``.
    """
    kwargs = kwargs or {}
    packet = _packet(op)
    if packet not in flop_registry and packet not in _FLOP_FORMULAS:
        return 0.0
    try:
        key = (_freeze(list(arg_shapes)), _freeze(kwargs), _freeze(out_shape))
        hash(key)
    except TypeError:
        return _eval_flops(op, tuple(arg_shapes), kwargs, out_shape)
    return _eval_flops_cached(resolve_op(op), key[0], key[1], key[2])


def _dtype_name(dtype: Any) -> torch.dtype | None:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            return value
    raise ValueError(f"unknown dtype {dtype!r}: pass a torch.dtype or its name, e.g. 'bfloat16'")


def peak_flops(dtype: Any, hw: Any) -> float:
    """Peak FLOP/s for ``dtype``: bf16/fp16/fp8 -> ``hw.peak_flops_bf16``, else fp32 peak.

    Raises:
        ValueError: for an unknown dtype name.
    """
    return float(hw.peak_flops_bf16 if _dtype_name(dtype) in _HALF_DTYPES else hw.peak_flops_fp32)


def _mm_dims(packet: Any, shapes: Sequence[Any]) -> tuple[int, int, int] | None:
    """``(M, N, K)`` of a matmul's operand shapes (batch folded into ``M``), or None."""
    try:
        if packet is aten.mm:
            (m, k), (_, n) = shapes[0], shapes[1]
        elif packet is aten.addmm:
            (m, k), (_, n) = shapes[1], shapes[2]
        elif packet in (aten.bmm, aten.baddbmm):
            a, b = (shapes[0], shapes[1]) if packet is aten.bmm else (shapes[1], shapes[2])
            (bt, m, k), (_, _, n) = a, b
            m = bt * m
        else:
            return None
    except (TypeError, ValueError, IndexError):
        return None
    return int(m), int(n), int(k)


def table_rates(op: Any, arg_shapes: Sequence[Any], args: Sequence[Any], kwargs: dict,
                nbytes: float, dtype: Any, hw: Any, phase: str
                ) -> tuple[float | None, float | None]:
    """``(compute efficiency, memory bandwidth bytes/s)`` of one op from ``hw``'s measured
    tables (module docstring), each None where no table covers it (then the
    constants); ``(None, None)`` without a profile.

    Args:
        op: the op (``OpOverload`` or name).
        arg_shapes: its positional arguments with tensors as local shapes.
        args, kwargs: its arguments as traced (for ``is_causal``).
        nbytes: bytes the kernel reads and writes.
        dtype: compute dtype (name or ``torch.dtype``).
        hw: :class:`~pipeline.costmodel.hardware.HardwareConfig`.
        phase: ``fwd`` or ``bwd`` (the node's phase).
    """
    tables = tables_of(hw)
    if tables is None:
        return None, None
    name = str(_dtype_name(dtype)).removeprefix("torch.")
    bandwidth = tables.memory_bandwidth(float(nbytes))
    packet = _packet(op)
    dims = _mm_dims(packet, arg_shapes)
    if dims is not None:
        return tables.matmul_efficiency(name, phase, *dims), bandwidth
    text = str(getattr(packet, "__name__", packet))
    if "scaled_dot_product" in text and isinstance(resolve_op(op), OpOverload):
        schema = [a.name for a in op_schema(resolve_op(op)).arguments]
        causal = kwargs.get("is_causal")
        if causal is None and "is_causal" in schema and schema.index("is_causal") < len(args):
            causal = args[schema.index("is_causal")]
        q = arg_shapes[0]
        if isinstance(q, (list, tuple)) and len(q) >= 2:
            eff = tables.attention_efficiency(name, "bwd" if "backward" in text else "fwd",
                                              int(q[-2]), int(q[-1]), bool(causal))
            return eff, bandwidth
    return None, bandwidth


def roofline_us(flops: Any, nbytes: Any, dtype: Any, hw: Any, is_view: bool,
                efficiency: float | None = None, bandwidth: float | None = None) -> Any:
    """Roofline time of one kernel in µs (Williams et al. 2009).

    ``max(flops / (peak(dtype) * eff_c), nbytes / (hbm_bw * eff_m)) * 1e6``, at least
    ``hw.kernel_floor_us``; exactly 0 when ``is_view``.

    Args:
        flops: FLOPs on one device (see :func:`op_flops`); number or numpy array.
        nbytes: bytes read + written by the kernel on one device; number or array.
        dtype: compute dtype (``torch.dtype`` or name) choosing the peak.
        hw: :class:`~pipeline.costmodel.hardware.HardwareConfig` (or DictConfig).
        is_view: True for view / metadata ops (:func:`is_view_op`).
        efficiency: the compute efficiency to use instead of ``hw.compute_efficiency``
            (a measured table's, :func:`table_rates`); None: the constant.
        bandwidth: the achieved memory bandwidth in bytes/s instead of ``hbm_bandwidth
            * memory_efficiency`` (a measured table's); None: the constants.

    Returns:
        µs: a float for scalar inputs, an array for array inputs.
    """
    if is_view:
        if np.ndim(flops) == 0 and np.ndim(nbytes) == 0:
            return 0.0
        return np.zeros(np.broadcast(np.asarray(flops), np.asarray(nbytes)).shape)
    peak = peak_flops(dtype, hw)
    eff = float(hw.compute_efficiency) if efficiency is None else float(efficiency)
    compute_s = flops / (peak * eff)
    bw = (float(hw.hbm_bandwidth) * float(hw.memory_efficiency) if bandwidth is None
          else float(bandwidth))
    memory_s = nbytes / bw
    floor = float(hw.kernel_floor_us)
    if np.ndim(compute_s) == 0 and np.ndim(memory_s) == 0:
        return max(max(compute_s, memory_s) * 1e6, floor)
    return np.maximum(np.maximum(compute_s, memory_s) * 1e6, floor)
