"""Facts about a run's nodes, worked out in the tests independently of the pipeline."""

from __future__ import annotations

from pipeline.core.ir import TENSOR_REF_RE


def weight_derived(nodes: list[dict]) -> set[str]:
    """Names of the parameters and of the ops computed from parameters only (rows of
    ``nodes.parquet``: a node's tensor arguments are the ``{"node": i}`` of its args)."""
    by_idx = {n["graph_idx"]: n for n in nodes if n["graph_idx"] is not None}
    out = {n["name"] for n in nodes if n["role"] == "param" and n["target"] == "placeholder"}
    for n in nodes:
        refs = [by_idx[int(i)]["name"] for i in TENSOR_REF_RE.findall(n["args"] or "")]
        if n["target"] not in ("placeholder", "output") and refs and set(refs) <= out:
            out.add(n["name"])
    return out
