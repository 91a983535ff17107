"""Module paths of traced nodes and the repeated block (layer) holding them.

Shared by the trace (:mod:`pipeline.stages.trace.stage`, which labels every node of the
graph IR with its ``module_path`` and ``layer``) and the depth-independent trace
(:mod:`pipeline.stages.trace.stamp`, which finds the containers whose children are such
layers). Plain strings only: no torch.
"""

from __future__ import annotations

import re

__all__ = ["layer_of_path", "module_path_of_stack"]


def module_path_of_stack(stack: dict | None) -> str:
    """Innermost module path of an ``nn_module_stack`` entry (``L['self'].layers.3.x`` ->
    ``layers.3.x``)."""
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)
    return re.sub(r"\[(\d+)\]", r".\1", path).replace("._modules['", ".").replace("']", "")


def layer_of_path(path: str | None) -> str | None:
    """Module path of the repeated block containing ``path`` (``layers.3.ffn.w1`` ->
    ``layers.3``, ``model.layers.0`` -> ``model.layers.0``, ``h.7.mlp`` -> ``h.7``)."""
    if not path:
        return None
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and i > 0:
            return ".".join(parts[: i + 1])
    return None
