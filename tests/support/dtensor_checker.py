"""Asks DTensor itself whether a (output, inputs) strategy of a traced node is one it
accepts: its sharding propagation on the node's real op schema (shapes, strides and
dtypes from the topology), then the op's strategy function. Used on chosen plans and on
samples of the enumerated strategies (tests/integration/test_plan_validity.py,
tests/integration/test_models.py): a check of the topology stage against the library it
enumerates from, not against our own code."""

from __future__ import annotations

import json
import math
from typing import Any


def _decode(obj: Any) -> Any:
    """A non-tensor argument of the graph IR back to its Python / torch value."""
    import torch

    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"dtype"}:
            return getattr(torch, obj["dtype"])
        if set(obj) == {"enum"}:
            text = obj["enum"]
            return getattr(torch, text.split(".", 1)[1]) if text.startswith("torch.") \
                else torch.device(text)
        if set(obj) == {"float"}:
            return float(obj["float"])
        if set(obj) == {"repr"}:
            raise _NotApplicable(f"argument {obj['repr']} not decodable")
        return {k: _decode(v) for k, v in obj.items()}
    return obj


class _NotApplicable(Exception):
    """An argument of the node that cannot be rebuilt as a Python / torch value."""


def _fmt_spec(spec: Any) -> str:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    from pipeline.dtensor.placements import format_placements

    if spec is None:
        return "-"
    if isinstance(spec, DTensorSpec):
        return format_placements(spec.placements)
    return "(" + "|".join(_fmt_spec(s) for s in spec) + ")"


class DTensorChecker:
    """Asks DTensor whether a (output, inputs) strategy of a node is one it accepts."""

    def __init__(self, tt: Any) -> None:
        from torch.distributed.tensor import DTensor

        from pipeline.stages.topology import device_mesh
        from pipeline.stages.trace.stage import fake_process_group

        self.tt = tt
        self.mesh_shape = tuple(int(m) for m in tt.summary["mesh"])
        fake_process_group(math.prod(self.mesh_shape))
        self.mesh = device_mesh(self.mesh_shape, tuple(tt.summary["mesh_names"]))
        self.prop = DTensor._op_dispatcher.sharding_propagator

    def schema(self, node: int, inputs: list[str]) -> Any:
        import torch
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._op_schema import OpSchema

        from pipeline.dtensor.placements import parse_placements

        n = self.tt.nodes
        pkt, overload = n["target"][node].split(".")[1:]
        op = getattr(getattr(torch.ops.aten, pkt), overload)
        metas = json.loads(n["in_metas"][node])
        counter = [0]

        def build(obj: Any) -> Any:
            if isinstance(obj, dict) and set(obj) == {"node"}:
                k = counter[0]
                counter[0] += 1
                m = metas[k]
                tm = TensorMeta(torch.Size(m["shape"]), tuple(m["stride"]),
                                getattr(torch, m["dtype"]))
                return DTensorSpec(self.mesh, parse_placements(inputs[k], len(self.mesh_shape)),
                                   tensor_meta=tm)
            if isinstance(obj, list):
                return [build(v) for v in obj]
            if isinstance(obj, dict) and not set(obj) & {"dtype", "enum", "float", "repr"}:
                return {k: build(v) for k, v in obj.items()}
            return _decode(obj)

        args = tuple(build(a) for a in json.loads(n["args"][node]))
        kwargs = {k: build(v) for k, v in json.loads(n["kwargs"][node]).items()}
        assert counter[0] == len(inputs), n["name"][node]
        return OpSchema(op, args, kwargs, schema_info=self.prop.op_to_schema_info.get(op))

    def check(self, node: int, output: str, inputs: list[str]) -> tuple[str, str]:
        """``("ok" | "ok-strategy-fn" | "bad" | "skip", detail)``.

        First DTensor's dispatch path: ``propagate_op_sharding`` with the inputs as given
        must need no input redistribution and give ``output``. If it prefers another
        strategy, the op's strategy function (what propagation chooses from) must
        list an OpSpec with exactly these inputs and this output (compared as text:
        ``_MaskPartial`` objects compare by mask buffer identity).
        """
        if self.tt.nodes["fallback"][node]:
            return "skip", "no DTensor strategy (replicate-only fallback)"
        try:
            schema = self.schema(node, inputs)
        except _NotApplicable as err:
            return "skip", str(err)
        try:
            out = self.prop.propagate_op_sharding(schema)
        except NotImplementedError as err:
            return "skip", f"no sharding strategy registered: {str(err)[:120]}"
        except Exception as err:  # noqa: BLE001 - DTensor rejects the inputs by raising
            return "bad", f"propagation raised {type(err).__name__}: {str(err)[:200]}"
        given = [_fmt_spec(s) for s in schema.args_spec]
        rs = out.redistribute_schema
        wanted = [_fmt_spec(s) for s in rs.args_spec] if rs is not None else given
        got = _fmt_spec(out.output_spec)
        if got == output and wanted == given:
            return "ok", ""
        found, detail = self._in_strategy_fn(schema, output, given)
        if found:
            return "ok-strategy-fn", f"propagation prefers {got} <- {wanted}"
        if self._is_extra(node, output, inputs):
            # context-parallel attention / vocab-parallel cross-entropy: not DTensor's,
            # exact by tests/unit/test_strategies_cp_loss.py
            return "extra", f"pipeline/stages/topology/extra_strategies.py ({got} <- {wanted})"
        return "bad", (f"propagation gives {got} and wants inputs {wanted}; strategy "
                       f"function: {detail}")

    def _is_extra(self, node: int, output: str, inputs: list[str]) -> bool:
        """Whether (output, inputs) is one of the strategies the topology appends to
        DTensor's for this op (an op of ``EXTRA_RULES``, and in its strategy list)."""
        from pipeline.stages.topology.extra_strategies import EXTRA_RULES

        n = self.tt.nodes
        if n["target"][node] not in EXTRA_RULES:
            return False
        s = n["slist"][node]
        return any(o == output and list(i) == list(inputs) for o, i in
                   zip(self.tt.slist_outputs[s], self.tt.slist_inputs[s]))

    def _in_strategy_fn(self, schema: Any, output: str, inputs: list[str]) -> tuple[bool, str]:
        from torch.distributed.tensor._op_schema import OpStrategy
        from torch.distributed.tensor._ops.single_dim_strategy import (
            _expand_single_dim_strategy_to_mesh,
        )

        op = schema.op
        strategy_schema = self.prop._wrap_with_op_strategy(schema)
        try:
            if op in self.prop.op_single_dim_strategy_funcs:
                out_meta = self.prop._propagate_tensor_meta_non_cached(schema)
                fn = _expand_single_dim_strategy_to_mesh(
                    self.mesh, strategy_schema, self.prop.op_single_dim_strategy_funcs[op],
                    out_meta)
                strategy = fn(op, strategy_schema.args_meta, strategy_schema.kwargs_meta)
            elif op in self.prop.op_strategy_funcs:
                strategy = self.prop.op_strategy_funcs[op](strategy_schema)
            else:
                return False, "none registered"
        except Exception as err:  # noqa: BLE001
            return False, f"raised {type(err).__name__}: {str(err)[:200]}"
        if not isinstance(strategy, OpStrategy):
            return False, f"returned {type(strategy).__name__}"
        listed = []
        for spec in strategy.strategies:
            outs = _fmt_spec(spec.output_specs)
            ins = ([_fmt_spec(s) for s in spec.input_specs] if spec.input_specs is not None
                   else [outs] * len(inputs))
            if outs == output and ins == inputs:
                return True, ""
            listed.append(f"{outs}<-{ins}")
        return False, f"{len(listed)} OpSpecs, e.g. {listed[:3]}"
