"""The graph IR's JSON helpers (pipeline/core/ir.py), on values worked out by hand, and
``resolve_op`` against the targets torch itself puts in a traced graph."""

from __future__ import annotations

import json
import math
import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pipeline.core.ir import (
    TENSOR_REF_RE,
    decode_shared,
    decode_value,
    is_tensor_ref,
    map_tensor_refs,
    resolve_op,
    tensor_refs,
    with_shapes,
)

# args of a node in flattened order: refs to 3, 5, 7 (the dict with two keys is a value)
ARGS = [{"node": 3}, [1, {"node": 5}], {"a": {"node": 7}, "b": {"node": 1, "x": 2}}]


def test_tensor_refs_in_flattened_order() -> None:
    assert tensor_refs(ARGS) == [3, 5, 7]
    assert tensor_refs({"node": 4}) == [4]
    assert tensor_refs([1, "node", None, {"dtype": "float32"}]) == []
    assert is_tensor_ref({"node": 0}) and not is_tensor_ref({"node": 0, "x": 1})


def test_map_tensor_refs_numbers_from_start() -> None:
    assert map_tensor_refs(ARGS, lambda k: f"t{k}") == [
        "t0", [1, "t1"], {"a": "t2", "b": {"node": 1, "x": 2}}]
    # kwargs continue the numbering of args
    assert map_tensor_refs({"weight": {"node": 9}}, lambda k: k, start=3) == {"weight": 3}


def test_with_shapes_past_the_end_is_none() -> None:
    assert with_shapes(ARGS, [(2, 3), (4,)]) == [(2, 3), [1, (4,)], {"a": None, "b": {
        "node": 1, "x": 2}}]
    assert with_shapes([{"node": 0}], [(1,), (5, 6)], start=1) == [(5, 6)]


def test_tensor_ref_regex_matches_the_ir_text() -> None:
    text = json.dumps([{"node": 12}, 3, {"node": 0}])
    assert TENSOR_REF_RE.sub("T", text) == "[T, 3, T]"


def test_decode_shared_decodes_each_text_once() -> None:
    texts = ['[{"shape": [2]}]', None, '[{"shape": [2]}]', "[]"]
    out = decode_shared(texts)
    assert out == [[{"shape": [2]}], None, [{"shape": [2]}], []]
    assert out[0] is out[2]


def test_decode_value_inverts_the_trace_tags() -> None:
    assert decode_value({"dtype": "bfloat16"}) is torch.bfloat16
    assert decode_value({"enum": "cpu"}) == torch.device("cpu")
    assert decode_value({"enum": "torch.contiguous_format"}) is torch.contiguous_format
    assert decode_value([{"float": "-inf"}, 2]) == [-math.inf, 2]
    assert decode_value({"a": {"dtype": "int64"}}) == {"a": torch.int64}


def test_resolve_op_gives_back_the_traced_targets() -> None:
    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.mm(x, w).relu() * 2.0).sum(dim=0)

    graph = make_fx(step)(torch.randn(4, 3), torch.randn(3, 5)).graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert len(targets) >= 4
    for target in targets:
        assert resolve_op(str(target)) is target


def test_resolve_op_forms() -> None:
    aten = torch.ops.aten
    assert resolve_op(aten.mm.default) is aten.mm.default
    assert resolve_op("torch.ops.aten.mm") is aten.mm.default
    # aten.mul has no .default: the first overload returning a Tensor
    assert resolve_op(aten.mul) is aten.mul.Tensor
    assert resolve_op("aten.mul") is aten.mul.Tensor
    assert resolve_op(operator.getitem) is operator.getitem


@pytest.mark.parametrize("name,fragment", [
    ("getitem", "expected 'namespace.op[.overload]'"),
    ("aten.no_such_op.default", "no such torch.ops entry"),
])
def test_resolve_op_unknown_names(name: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=f"cannot resolve op '{name}'") as err:
        resolve_op(name)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert resolve_op(name, strict=False) is None
