"""CPU kernels for the fused ops of a traced step that have none, so it runs on CPU.

The built-in model calls ``aten._scaled_dot_product_flash_attention`` directly so that
attention is one node of the traced graph, as on a GPU. That
op and its backward have CUDA and meta kernels only. :func:`cpu_kernels`
registers CPU kernels for both, for the duration of a ``with`` block, computed by the
CPU flash attention ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its
backward): the same attention (softmax(q k^T * scale + causal mask) v) and the same
log-sum-exp. The outputs the CUDA op adds for variable-length batches and dropout
(``cum_seq_q/k``: undefined; ``max_q/k``: the sequence lengths; ``rng_state``,
``unused``: zeros, as with ``dropout_p=0``; ``debug_attn_mask``: empty) are those of
the op's meta kernel, and so is the output's layout (``empty_like(query)``: a query
transposed from ``[B, T, H, D]`` gives an output the traced graph views without a copy
after transposing it back). Dropout is refused (the CPU kernel has no RNG state
to return). Both the single-process reference step (eager autograd) and DTensor's
local computation dispatch to these kernels. Other ops without a CPU kernel that
torch can decompose (``aten._fused_rms_norm_backward``, the backward of
``F.rms_norm`` traced on meta) get their decomposition as CPU kernel.

Ops whose CPU kernel lacks a dtype the trace used get a CPU kernel covering it, when
they are among the ops given: ``aten.histc`` counts integer inputs on CUDA but not on
CPU (``"histogram_cpu" not implemented for 'Int'``); transformers' grouped-mm MoE
experts, traced on meta, count the tokens per expert with ``histc`` of int32 expert
ids. The replacement counts by ``bincount`` of the bin indices (histc's semantics:
``bins`` equal bins over ``[min, max]``, the data's range when ``min == max``, values
outside ignored, ``max`` in the last bin), any dtype, the result in the input's dtype.
Their meta kernels, which DTensor's sharding propagation runs on fake CPU tensors, are
replaced too where the stock one copies a CUDA-only dtype check: ``histc`` (integers),
and ``aten._grouped_mm``, whose CPU kernel computes float32 but whose meta kernel asks
for bf16 (a bf16 trace executed in float32); the replacement is the stock meta kernel
run in bf16, its output in the inputs' dtype.

The registration is removed when the block exits (each ``torch.library.Library`` is
destroyed, :func:`pipeline.dtensor.torch_compat.impl_library`), so nothing outlives the
caller.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pipeline.dtensor.torch_compat import (
    decomposition,
    has_kernel_for_dispatch_key,
    impl_library,
    meta_grouped_mm,
    op_name_parts,
)


def _flash_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   dropout_p: float = 0.0, is_causal: bool = False,
                   return_debug_mask: bool = False, *, scale: float | None = None) -> tuple:
    if dropout_p:
        raise NotImplementedError(
            f"dropout_p={dropout_p}: the CPU flash-attention kernel of "
            "pipeline.dtensor.cpu_kernels "
            "supports dropout_p=0 only")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, scale=scale)
    # the layout of the op's meta kernel (``empty_like(query)``), which the trace
    # recorded: the graph may view the output's transpose without a copy
    out = torch.empty_like(query).copy_(out)
    return (out, lse, None, None, query.size(2), key.size(2),
            torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64),
            torch.empty(0, dtype=query.dtype))


def _flash_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor,
                    cum_seq_q: Any, cum_seq_k: Any, max_q: int, max_k: int, dropout_p: float,
                    is_causal: bool, philox_seed: Any, philox_offset: Any, *,
                    scale: float | None = None) -> tuple:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)


def _histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0
           ) -> torch.Tensor:
    lo, hi = float(min), float(max)
    x = input.detach().reshape(-1).double()
    if lo == hi and x.numel():
        lo, hi = float(x.min()), float(x.max())
    if lo == hi:
        lo, hi = lo - 1.0, hi + 1.0
    x = x[(x >= lo) & (x <= hi)]
    index = ((x - lo) * (bins / (hi - lo))).long().clamp_(0, bins - 1)
    return torch.bincount(index, minlength=bins).to(input.dtype)


def _histc_meta(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0
                ) -> torch.Tensor:
    return torch.empty(bins, dtype=input.dtype, device=input.device)


def _grouped_mm_meta(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: Any = None,
                     bias: Any = None, out_dtype: Any = None) -> torch.Tensor:
    low = torch.bfloat16
    out = meta_grouped_mm(mat_a.to(low), mat_b.to(low), offs=offs,
                          bias=None if bias is None else bias.to(low), out_dtype=low)
    return torch.empty_strided(out.shape, out.stride(), dtype=out_dtype or mat_a.dtype,
                               device=mat_a.device)


#: CPU kernels replacing ones that lack a dtype the trace used, with the meta kernel
#: that lets DTensor's sharding propagation (fake CPU tensors) accept that dtype (the
#: stock one refuses what the stock CPU kernel cannot run); see the module docstring.
_DTYPE_GAPS: dict[str, tuple[Any, Any]] = {
    "aten::histc": (_histc, _histc_meta),
    "aten::_grouped_mm": (None, _grouped_mm_meta),
}


def has_cpu_kernel(op: Any) -> bool:
    """Whether ``op`` (an ``OpOverload``) runs on CPU tensors without help."""
    name = op.name()
    return any(has_kernel_for_dispatch_key(name, key) for key in
               ("CPU", "CompositeImplicitAutograd", "CompositeExplicitAutograd"))


_FLASH: dict[str, Any] = {
    "aten::_scaled_dot_product_flash_attention": _flash_forward,
    "aten::_scaled_dot_product_flash_attention_backward": _flash_backward,
}


@contextlib.contextmanager
def cpu_kernels(ops: Iterable[Any] = ()) -> Iterator[list[str]]:
    """Register CPU kernels inside the block for the flash-attention forward and
    backward ops and for every op of ``ops`` (``OpOverload`` objects, e.g. the ops of a
    traced graph) that has no CPU kernel but a decomposition in
    ``torch._decomp.decomposition_table`` (``_fused_rms_norm_backward``: its
    decomposition is its CPU kernel), or whose CPU kernel lacks a dtype (``histc`` of
    integers). Yields the names of the ops registered.
    """
    todo: dict[str, Any] = {}
    for op in list(ops) + [torch.ops.aten._scaled_dot_product_flash_attention.default,
                           torch.ops.aten._scaled_dot_product_flash_attention_backward.default]:
        if op is None or op.name() in todo:
            continue
        if op.name() in _DTYPE_GAPS:
            todo[op.name()] = (op, *_DTYPE_GAPS[op.name()])
            continue
        if has_cpu_kernel(op):
            continue
        fn = _FLASH.get(op.name()) or decomposition(op)
        if fn is not None:
            todo[op.name()] = (op, fn, None)
    libs: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:  # each library's registrations end on exit
        for name, (op, fn, meta) in todo.items():
            ns, _, short = name.partition("::")
            lib = libs.get(ns)
            if lib is None:
                lib = libs[ns] = stack.enter_context(impl_library(ns))
            overload = op_name_parts(op)[2]
            with warnings.catch_warnings():  # replacing histc's CPU kernel is intended
                warnings.filterwarnings("ignore", message="(?s).*Overriding a previously "
                                        "registered kernel", category=UserWarning)
                qualified = short if overload == "default" else f"{short}.{overload}"
                if fn is not None:
                    lib.impl(qualified, fn, "CPU")
                if meta is not None:
                    lib.impl(qualified, meta, "Meta")
        yield sorted(todo)
