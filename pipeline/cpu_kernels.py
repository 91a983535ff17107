"""CPU kernels for the fused ops of a traced step that have none, so it runs on CPU.

The built-in model calls ``aten._scaled_dot_product_flash_attention`` directly so that
attention is one node of the traced graph, as on a GPU (shared/NOTES-torch.md). That
op and its backward have CUDA and meta kernels only. :func:`cpu_kernels`
registers CPU kernels for both, for the duration of a ``with`` block, computed by the
CPU flash attention ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its
backward): the same attention (softmax(q k^T * scale + causal mask) v) and the same
log-sum-exp. The outputs the CUDA op adds for variable-length batches and dropout
(``cum_seq_q/k``: undefined; ``max_q/k``: the sequence lengths; ``rng_state``,
``unused``: zeros, as with ``dropout_p=0``; ``debug_attn_mask``: empty) are those of
the op's meta kernel. Dropout is refused (the CPU kernel has no RNG state
to return). Both the single-process reference step (eager autograd) and DTensor's
local computation dispatch to these kernels. Other ops without a CPU kernel that
torch can decompose (``aten._fused_rms_norm_backward``, the backward of
``F.rms_norm`` traced on meta) get their decomposition as CPU kernel.

The registration is removed when the block exits (``torch.library.Library`` is
destroyed), so nothing outlives the caller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def _flash_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   dropout_p: float = 0.0, is_causal: bool = False,
                   return_debug_mask: bool = False, *, scale: float | None = None) -> tuple:
    if dropout_p:
        raise NotImplementedError(
            f"dropout_p={dropout_p}: the CPU flash-attention kernel of pipeline.cpu_kernels "
            "supports dropout_p=0 only")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, scale=scale)
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


def has_cpu_kernel(op: Any) -> bool:
    """Whether ``op`` (an ``OpOverload``) runs on CPU tensors without help."""
    name = op.name()
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in
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
    decomposition is its CPU kernel). Yields the names of the ops registered.
    """
    from torch._decomp import decomposition_table

    todo: dict[str, Any] = {}
    for op in list(ops) + [torch.ops.aten._scaled_dot_product_flash_attention.default,
                           torch.ops.aten._scaled_dot_product_flash_attention_backward.default]:
        if op is None or has_cpu_kernel(op) or op.name() in todo:
            continue
        fn = _FLASH.get(op.name()) or decomposition_table.get(op)
        if fn is not None:
            todo[op.name()] = (op, fn)
    libs: dict[str, Any] = {}
    try:
        for name, (op, fn) in todo.items():
            ns, _, short = name.partition("::")
            lib = libs.get(ns)
            if lib is None:
                lib = libs[ns] = torch.library.Library(ns, "IMPL")
            overload = op._overloadname
            lib.impl(short if overload == "default" else f"{short}.{overload}", fn, "CPU")
        yield sorted(todo)
    finally:
        for lib in libs.values():
            lib._destroy()
