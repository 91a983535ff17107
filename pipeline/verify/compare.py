"""Comparing a sharded step with the unsharded one: :func:`reference_step` (the
single-process step) and :func:`difference` (max absolute and relative difference).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["RTOL", "difference", "reference_step"]

#: Largest relative difference (``max|a - b| / max|b|``) of the loss and of every
#: gradient accepted, float32.
RTOL = 1e-5


def reference_step(model: Any, inputs: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
    """The unsharded training step in one process: ``loss = model(*inputs)``,
    ``loss.backward()``; returns the loss and ``{fqn: grad}``."""
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return loss.detach(), grads


def difference(got: Any, ref: Any) -> dict[str, float]:
    """``{"abs_diff": max|a - b|, "rel_diff": max|a - b| / max|b|}`` (0 when equal)."""
    diff = float((got.double() - ref.double()).abs().max()) if got.numel() else 0.0
    scale = float(ref.double().abs().max()) if ref.numel() else 0.0
    rel = 0.0 if diff == 0.0 else (diff / scale if scale > 0 else math.inf)
    return {"abs_diff": diff, "rel_diff": rel}
