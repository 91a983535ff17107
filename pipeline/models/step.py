"""The captured training step of a built model: tied parameters, mixed precision, loss.

:func:`training_step` prepares a :class:`~pipeline.models.BuiltModel` for
``aot_export_joint_with_descriptors`` and undoes every change on exit:

* **Tied parameters** (``lm_head.weight is transformer.wte.weight``): the export lists a
  module's parameters with ``remove_duplicate=False``, so one tensor under two names
  became two placeholders, two placements and two gradients, its memory counted twice.
  Every alias name is removed from its module for the capture, so the graph has one
  placeholder per parameter *tensor* (its first name in ``named_parameters`` order),
  and the step puts the same traced tensor back under each alias before the forward
  runs: both uses read one placeholder and autograd sums their gradients into one.
* **Mixed precision** (FSDP2's ``MixedPrecisionPolicy``, as the built-in model): each
  floating parameter is cast to ``compute_dtype`` inside the step, under the module path
  of the module owning it (so the cast belongs to its layer, and repeated layers stay
  copies); gradients flow back through the cast to the float32 parameter.
* **The step**: ``module.forward`` is replaced (on the instance) by the family's
  ``step(original_forward, *inputs) -> loss``.

A model without a step, ties or a compute dtype (the built-in LLaMA) is captured as is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["parameter_count", "tied_parameters", "training_step"]


def tied_parameters(module: Any) -> dict[str, str]:
    """``{alias name: canonical name}`` of every parameter reachable under more than one
    name; the canonical name is the first in ``named_parameters()`` order."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def parameter_count(module: Any) -> int:
    """Elements of the distinct parameter tensors (a tied tensor counted once)."""
    return sum(p.numel() for p in module.parameters())


def _owner(name: str) -> tuple[str, str]:
    path, _, leaf = name.rpartition(".")
    return path, leaf


@contextlib.contextmanager
def training_step(built: Any) -> Iterator[tuple[Any, dict[str, str]]]:
    """Yield ``(module to capture, tied aliases)`` (see the module docstring)."""
    module = built.module
    aliases = tied_parameters(module)
    if built.step is None and built.compute_dtype is None and not aliases:
        yield module, {}
        return
    import torch
    import torch.fx.traceback as fxt

    from pipeline.dtensor.torch_compat import reparametrize_module

    removed = []
    for alias in aliases:
        path, leaf = _owner(alias)
        owner = module.get_submodule(path)
        removed.append((owner, leaf, owner._parameters.pop(leaf)))
    original_forward = module.forward
    dtype = built.compute_dtype
    step = built.step

    def forward(*inputs: Any) -> Any:
        swapped: dict[str, Any] = {}
        for name, p in module.named_parameters():
            if dtype is not None and p.is_floating_point() and p.dtype != dtype:
                with fxt.annotate({"module_path": _owner(name)[0]}):
                    p = p.to(dtype)
            swapped[name] = p
        for alias, canonical in aliases.items():
            swapped[alias] = swapped[canonical]
        with reparametrize_module(module, swapped, strict=False):
            if step is None:
                return original_forward(*inputs)
            return step(original_forward, *inputs)

    module.forward = forward
    try:
        with torch.autograd.set_grad_enabled(True):
            yield module, aliases
    finally:
        del module.forward
        for owner, leaf, p in removed:
            owner._parameters[leaf] = p
