"""Composite ops keep their backward on meta tensors during the capture.

**Why a loss's backward vanished.** ``F.cross_entropy`` reaches ``aten::nll_loss``, an op
with a ``CompositeImplicitAutograd`` kernel only: on every backend (CPU, CUDA, Meta) its
C++ dispatch table runs that composite at the autograd key, and the composite calls
``nll_loss_forward``, which has a derivative (``nll_loss_backward``). But importing torch
runs ``torch._meta_registrations.activate_meta()``, which registers each Python
decomposition (``torch._refs.nn.functional.nll_loss`` among them) as a *Python* kernel
of the ``Meta`` key (``op_overload.py_impl(DispatchKey.Meta)``); for a
``CompositeImplicitAutograd`` op it deliberately registers no C++ meta kernel ("we
should be letting those decompositions run"), but the Python one stays.

The joint capture (``aot_export_joint_with_descriptors``: make_fx with the Python
dispatcher on) resolves each op's dispatch key in Python (``torch._ops.resolve_key``).
For ``AutogradMeta`` rule 2.3 takes the ``CompositeImplicitAutograd`` kernel only when
the op has no backend kernel for the key's backend (``has_backend_kernel``); the Python
``Meta`` kernel is one, so resolution falls through to the backend fallback of
``AutogradMeta``: ``autograd_not_implemented_fallback``, which records no derivative
("aten::nll_loss: an autograd kernel was not registered to the Autograd key(s)", a
warning). The forward is traced unchanged, the backward of everything upstream of the
op is lost, and every gradient output is None. On CPU tensors the same step traces
with its backward (the CPU key has no Python kernel). The same holds for every such op
(torch 2.13: ``nll_loss``, ``var``, ``var_mean``, ``relu6``, ``selu``, ``prelu``,
``hinge_embedding_loss``, ``margin_ranking_loss``, ``pdist``, the ``fft_*n`` family, ...).

**The fix** (:func:`composite_autograd_on_meta`): for the capture, the Python ``Meta``
kernel of each op that would lose its derivative this way is taken out of the op's
``py_kernels`` (and its dispatch cache cleared), so the Python dispatcher resolves as
the C++ table does: ``AutogradMeta`` -> the op's ``CompositeImplicitAutograd`` kernel,
which decomposes above autograd into ops with derivatives. The kernels are put back on
exit. Only ops that have a C++ ``CompositeImplicitAutograd`` kernel, no C++ ``Meta``,
``CompositeExplicitAutograd`` or ``Autograd`` kernel (an op with its own derivative,
``_fused_rms_norm``, keeps it through rule 2.4: its trace must not change) and no Python
kernel at an autograd key (``Autograd``, ``AutogradMeta``, ``CompositeImplicitAutograd``:
those already resolve there, ``aten::dropout``) are touched. The graph nodes of an op
that was traced anyway (on tensors without gradients) do not change: make_fx decomposed
it with the same composite kernel below autograd.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["composite_autograd_on_meta", "ops_losing_autograd_on_meta"]


def ops_losing_autograd_on_meta() -> list[tuple[Any, Any]]:
    """``[(op overload, its Python Meta kernel)]`` of the ops whose ``AutogradMeta`` key
    the Python dispatcher sends to the autograd fallback although their C++ table runs
    their ``CompositeImplicitAutograd`` kernel there (see the module docstring)."""
    from pipeline.dtensor.torch_compat import (
        decomposed_overloads,
        has_kernel_for_dispatch_key,
        has_python_kernel,
        python_kernel,
    )

    autograd_keys = ("Autograd", "AutogradMeta", "CompositeImplicitAutograd")
    found = []
    for op in decomposed_overloads():
        kernel = python_kernel(op, "Meta")
        name = op.name()
        if (kernel is not None
                and has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
                and not has_kernel_for_dispatch_key(name, "Meta")
                and not has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")
                and not has_kernel_for_dispatch_key(name, "Autograd")
                and not has_python_kernel(op, autograd_keys)):
            found.append((op, kernel))
    return found


@contextlib.contextmanager
def composite_autograd_on_meta() -> Iterator[int]:
    """Within the block, the ops of :func:`ops_losing_autograd_on_meta` dispatch on meta
    tensors as their C++ table says (no Python ``Meta`` kernel); yields their count.
    The kernels are restored on exit, also on an error."""
    from pipeline.dtensor.torch_compat import set_python_kernel

    lifted = ops_losing_autograd_on_meta()
    try:
        for op, _ in lifted:
            set_python_kernel(op, "Meta", None)
        yield len(lifted)
    finally:
        for op, kernel in lifted:
            set_python_kernel(op, "Meta", kernel)
