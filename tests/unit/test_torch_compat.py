"""The private torch APIs of pipeline/dtensor/torch_compat.py, one test each, on real torch.

Each test checks that the API exists, is what the project calls (signature, fields) and,
where cheap, answers one small real call as torch 2.13 does. A failure names the API and
the module that reaches it, so a torch upgrade that removes or changes one says which.
(A name that is gone fails the import of torch_compat itself, with the same message.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import pipeline.dtensor.torch_compat as tc

aten = torch.ops.aten


@contextlib.contextmanager
def api(name: str) -> Iterator[None]:
    """Turn any failure inside into one naming the torch API and torch_compat."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - reported, naming the API
        pytest.fail(f"{name}: {type(err).__name__}: {err} (torch {torch.__version__}; "
                    "reached through pipeline/dtensor/torch_compat.py, written for 2.13)")


def params(func: Any) -> list[str]:
    return list(inspect.signature(func).parameters)


def fields(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.fixture(scope="module")
def mesh() -> Any:
    from pipeline.stages.topology import device_mesh

    return device_mesh((2, 4), ("dp", "tp"))


def meta(*shape: int) -> Any:
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return tc.TensorMeta(torch.Size(shape), tuple(stride), torch.float32)


def strategy(mesh: Any, placements: tuple, tensor_meta: Any) -> Any:
    return tc.OpStrategy([tc.OpSpec(tc.DTensorSpec(mesh, placements, tensor_meta=tensor_meta))])


# --------------------------------------------------------------- operators, dispatcher


def test_op_overload_classes() -> None:
    with api("torch._ops.OpOverload / OpOverloadPacket / HigherOrderOperator"):
        assert isinstance(aten.mm.default, tc.OpOverload)
        assert isinstance(aten.mm, tc.OpOverloadPacket)
        assert isinstance(torch.ops.higher_order.cond, tc.HigherOrderOperator)
        assert not isinstance(aten.mm, tc.OpOverload)


def test_op_schema() -> None:
    with api("torch._ops.OpOverload._schema"):
        mm = tc.op_schema(aten.mm.default)
        assert mm.name == "aten::mm" and not mm.is_mutable
        assert [a.name for a in mm.arguments] == ["self", "mat2"]
        assert mm.returns[0].alias_info is None and str(mm.arguments[0].type) == "Tensor"
        view = tc.op_schema(aten.view.default).returns[0].alias_info
        assert view is not None and not view.is_write
        assert tc.op_schema(aten.add_.Tensor).is_mutable


def test_op_name_parts() -> None:
    with api("torch._ops.OpOverload._opname / _overloadname"):
        assert tc.op_name_parts(aten.mm.default) == ("aten", "mm", "default")
        assert tc.op_name_parts(aten.add.Tensor) == ("aten", "add", "Tensor")


def test_qualified_op_name() -> None:
    with api("torch._ops.OpOverloadPacket._qualified_op_name"):
        assert tc.qualified_op_name(aten.mm) == "aten::mm"
        packet = torch.ops._c10d_functional.all_gather_into_tensor
        assert tc.qualified_op_name(packet) == "_c10d_functional::all_gather_into_tensor"
        assert aten.mm.default.overloadpacket is aten.mm


def test_has_kernel_for_dispatch_key() -> None:
    with api("torch._C._dispatch_has_kernel_for_dispatch_key"):
        assert tc.has_kernel_for_dispatch_key("aten::mm", "CPU")
        assert not tc.has_kernel_for_dispatch_key(
            "aten::_scaled_dot_product_flash_attention", "CPU")


def test_decomposition_table() -> None:
    with api("torch._decomp.decomposition_table"):
        fn = tc.decomposition(aten._fused_rms_norm_backward.default)
        assert callable(fn)


def test_meta_grouped_mm() -> None:
    with api("torch._meta_registrations.meta_grouped_mm"):
        assert params(tc.meta_grouped_mm)[:5] == ["mat_a", "mat_b", "offs", "bias", "out_dtype"]
        a = torch.empty(8, 16, dtype=torch.bfloat16, device="meta")
        b = torch.empty(2, 16, 8, dtype=torch.bfloat16, device="meta")
        offs = torch.empty(2, dtype=torch.int32, device="meta")
        out = tc.meta_grouped_mm(a, b, offs=offs, bias=None, out_dtype=torch.bfloat16)
        assert tuple(out.shape) == (8, 8)


def test_library_destroy() -> None:
    name = "aten::_scaled_dot_product_flash_attention"
    with api("torch.library.Library._destroy"):
        assert callable(torch.library.Library._destroy)
        with tc.impl_library("aten") as lib:
            lib.impl("_scaled_dot_product_flash_attention", lambda *a, **k: None, "CPU")
            assert tc.has_kernel_for_dispatch_key(name, "CPU")
        assert not tc.has_kernel_for_dispatch_key(name, "CPU")


# ------------------------------------------------------------- placements and specs


def test_strided_shard() -> None:
    with api("torch.distributed.tensor.placement_types._StridedShard"):
        p = tc.StridedShard(1, split_factor=4)
        assert (p.dim, p.split_factor) == (1, 4)
        assert isinstance(p, tc.C_STRIDED_SHARD)


def test_mask_partial_and_buffer() -> None:
    with api("torch.distributed.tensor.placement_types._MaskPartial / MaskBuffer"):
        buf = tc.MaskBuffer()
        p = tc.MaskPartial("sum", buf, torch.Size([4, 2]), 0)
        assert (p.reduce_op, tuple(p.offset_shape), p.offset_dim) == ("sum", (4, 2), 0)
        assert p.mask_buffer is buf and p.is_partial() and isinstance(p, Partial)
        q = tc.MaskPartial(reduce_op="max", offset_shape=None, offset_dim=1)
        assert (q.reduce_op, q.offset_shape, q.offset_dim) == ("max", None, 1)


def test_norm_partial() -> None:
    with api("torch.distributed.tensor._ops._math_ops._NormPartial"):
        assert tc.NormPartial is not None
        p = tc.NormPartial(norm_type=2)
        assert p.norm_type == 2 and p.is_partial() and isinstance(p, Partial)


def test_c_placement_bases() -> None:
    with api("torch._C._distributed.Shard / StridedShard / Replicate / Partial"):
        assert isinstance(Shard(0), tc.C_SHARD) and isinstance(Replicate(), tc.C_REPLICATE)
        assert isinstance(Partial(), tc.C_PARTIAL)
        assert isinstance(tc.StridedShard(0, split_factor=2), tc.C_STRIDED_SHARD)


def test_tensor_meta_and_spec(mesh: Any) -> None:
    with api("torch.distributed.tensor._dtensor_spec.TensorMeta / DTensorSpec"):
        m = meta(8, 16)
        assert (tuple(m.shape), m.stride, m.dtype) == ((8, 16), (16, 1), torch.float32)
        spec = tc.DTensorSpec(mesh, (Shard(0), Replicate()), tensor_meta=m)
        assert tuple(spec.placements) == (Shard(0), Replicate()) and spec.mesh is mesh


def test_strided_shard_order(mesh: Any) -> None:
    with api("DTensorSpec._normalize_placements_into_shard_order / "
             "_StridedShardNotDecodableError"):
        assert issubclass(tc.StridedShardNotDecodableError, ValueError)
        norm, order = tc.normalize_strided_shard_order(
            (tc.StridedShard(0, split_factor=4), Shard(0)), mesh)
        assert norm == (Shard(0), Shard(0))
        assert [(e.tensor_dim, tuple(e.mesh_dims)) for e in order] == [(0, (1, 0))]
        with pytest.raises(tc.StridedShardNotDecodableError):
            tc.normalize_strided_shard_order((tc.StridedShard(0, split_factor=3), Shard(0)),
                                             mesh)


def test_default_shard_order() -> None:
    with api("DTensorSpec.compute_default_shard_order"):
        order = tc.default_shard_order((Shard(0), Shard(0)))
        assert [(e.tensor_dim, tuple(e.mesh_dims)) for e in order] == [(0, (0, 1))]


# --------------------------------------------------------------------- strategies


def test_op_schema_and_strategies(mesh: Any) -> None:
    with api("torch.distributed.tensor._op_schema.OpSchema / OpSpec / OpStrategy / "
             "TupleStrategy"):
        a = strategy(mesh, (Shard(0), Replicate()), meta(8, 16))
        assert a.strategies[0].output_spec.placements == (Shard(0), Replicate())
        assert a.strategies[0].input_specs is None
        pair = tc.TupleStrategy([a, a])
        assert list(pair.children) == [a, a]
        schema = tc.OpSchema(aten.mm.default, (a, a), {}, schema_info=None)
        assert len(schema.args_meta) == 2 and schema.kwargs_meta == {}
        assert tuple(schema.args_meta[0].shape) == (8, 16)


def test_sharding_propagator() -> None:
    with api("DTensor._op_dispatcher.sharding_propagator"):
        prop = tc.sharding_propagator()
        assert prop is DTensor._op_dispatcher.sharding_propagator
        for name in ("op_single_dim_strategy_funcs", "op_strategy_funcs", "op_to_schema_info"):
            assert isinstance(getattr(prop, name), dict), name


def test_single_dim_strategy_of_mm(mesh: Any) -> None:
    """mm's rules per mesh dim (tests/test_topology.py counts their expansion)."""
    with api("ShardingPropagator.op_single_dim_strategy_funcs[op].func / "
             "_ops.single_dim_strategy._ShardingPlaceholder"):
        func = tc.single_dim_strategy_func(aten.mm.default)
        assert callable(func) and tc.single_dim_strategy_func(aten.unbind.int) is None
        rep = (Replicate(), Replicate())
        schema = tc.OpSchema(aten.mm.default, (strategy(mesh, rep, meta(8, 16)),
                                               strategy(mesh, rep, meta(16, 4))), {})
        rules = func(aten.mm.default, schema.args_meta, schema.kwargs_meta)

        def token(p: Any) -> str:
            if isinstance(p, tc.ShardingPlaceholder):
                return f"S({p.dim})"
            return "R" if isinstance(p, Replicate) else f"P({p.reduce_op})"

        assert sorted(tuple(token(p) for p in r) for r in rules) == sorted([
            ("P(sum)", "S(1)", "S(0)"), ("S(0)", "S(0)", "R"), ("S(1)", "R", "S(1)"),
            ("P(sum)", "P(sum)", "R"), ("P(sum)", "R", "P(sum)"), ("P(avg)", "P(avg)", "R"),
            ("P(avg)", "R", "P(avg)")])


def test_op_strategy_of_unbind_and_its_rejection(mesh: Any) -> None:
    with api("ShardingPropagator.op_strategy_funcs / op_to_schema_info; DTensor's "
             "rejection of a placement (torch_compat.STRATEGY_REJECTIONS, RuntimeError)"):
        func = tc.op_strategy_func(aten.unbind.int)
        info = tc.op_schema_info(aten.unbind.int)
        assert callable(func) and info is not None and info.static_argnum == 1

        def unbind(placements: tuple) -> Any:
            arg = strategy(mesh, placements, meta(4, 8))
            return func(tc.OpSchema(aten.unbind.int, (arg, 0), {}, schema_info=info))

        out = unbind((Shard(1), Replicate()))
        assert isinstance(out, tc.OpStrategy) and len(out.strategies) == 1
        assert [tuple(s.placements) for s in out.strategies[0].output_specs] == [
            (Shard(0), Replicate())] * 4
        with pytest.raises(RuntimeError) as rejected:
            unbind((Shard(0), Replicate()))
        assert tc.strategy_rejection(rejected.value, every_candidate=False)


def test_nll_loss_refuses_unequal_candidate_counts(mesh: Any) -> None:
    """The IndexError that STRATEGY_REJECTIONS admits in the all-candidate call only."""
    with api("ShardingPropagator.op_strategy_funcs[aten.nll_loss_forward.default]"):
        func = tc.op_strategy_func(aten.nll_loss_forward.default)
        logits = tc.OpStrategy([
            tc.OpSpec(tc.DTensorSpec(mesh, p, tensor_meta=meta(8, 16)))
            for p in [(Replicate(), Replicate()), (Shard(0), Replicate())]])
        target = strategy(mesh, (Replicate(), Replicate()),
                          tc.TensorMeta(torch.Size([8]), (1,), torch.int64))
        schema = tc.OpSchema(aten.nll_loss_forward.default, (logits, target, None, 1, -100),
                             {}, schema_info=tc.op_schema_info(aten.nll_loss_forward.default))
        with tc.zero_redistribute_costs(), pytest.raises(IndexError) as refused:
            func(schema)
        assert tc.strategy_rejection(refused.value, every_candidate=True)
        assert not tc.strategy_rejection(refused.value, every_candidate=False)


def test_expand_refuses_a_shard_of_a_broadcast_dim(mesh: Any) -> None:
    """The KeyError that STRATEGY_REJECTIONS admits from the view rules."""
    with api("ShardingPropagator.op_strategy_funcs[aten.expand.default] "
             "(_ops/_view_ops.py _rewrite_plain_shard)"):
        func = tc.op_strategy_func(aten.expand.default)
        arg = strategy(mesh, (Shard(1), Replicate()), meta(4, 1, 8))
        schema = tc.OpSchema(aten.expand.default, (arg, [4, 6, 8]), {},
                             schema_info=tc.op_schema_info(aten.expand.default))
        with tc.zero_redistribute_costs(), pytest.raises(KeyError) as refused:
            func(schema)
        assert tc.strategy_rejection(refused.value, every_candidate=False)
        ok = func(tc.OpSchema(aten.expand.default,
                              (strategy(mesh, (Shard(0), Replicate()), meta(4, 1, 8)),
                               [4, 6, 8]), {}))
        assert [tuple(s.output_spec.placements) for s in ok.strategies] == [
            (Shard(0), Replicate())]


def _raised(err: Exception) -> Exception:
    try:
        raise err
    except Exception as caught:  # noqa: BLE001 - returned with its traceback
        return caught


def test_other_exceptions_are_no_rejection() -> None:
    """Raised outside DTensor, or of another type, an exception rejects nothing."""
    assert not tc.strategy_rejection(_raised(TypeError("x")), every_candidate=True)
    assert not tc.strategy_rejection(_raised(RuntimeError("x")), every_candidate=True)
    assert not tc.strategy_rejection(_raised(KeyError("x")), every_candidate=True)
    assert not tc.strategy_rejection(_raised(NotImplementedError("x")), every_candidate=True)


def test_strategy_function_error_names_the_op() -> None:
    err = tc.StrategyFunctionError.of(aten.mm.default, TypeError("bad argument"))
    text = str(err)
    assert "aten.mm.default" in text and "TypeError: bad argument" in text
    assert "STRATEGY_REJECTIONS" in text and "torch_compat.py" in text
    assert isinstance(err, tc.TorchAPIError)


def test_generate_redistribute_costs_patch() -> None:
    name = "generate_redistribute_costs"
    with api(f"torch.distributed.tensor._ops.utils.{name}"):
        utils = importlib.import_module("torch.distributed.tensor._ops.utils")
        original = getattr(utils, name)
        assert params(original) == ["src_strategy", "dst_spec"]
        with tc.zero_redistribute_costs() as patched:
            assert "torch.distributed.tensor._ops.utils" in patched
            assert "torch.distributed.tensor._ops._matrix_ops" in patched
            for key in patched:
                assert getattr(sys.modules[key], name) is not original
        for key in patched:
            assert getattr(sys.modules[key], name) is original


def test_generate_redistribute_costs_patch_raises_when_gone(monkeypatch: Any) -> None:
    utils = importlib.import_module("torch.distributed.tensor._ops.utils")
    monkeypatch.delattr(utils, "generate_redistribute_costs")
    with pytest.raises(tc.TorchAPIError, match="generate_redistribute_costs.*torch_compat"):
        with tc.zero_redistribute_costs():
            pass


def test_local_tensor(mesh: Any) -> None:
    with api("DTensor._local_tensor"):
        t = torch.arange(6.0).reshape(2, 3)
        dt = DTensor.from_local(t, mesh, (Replicate(), Replicate()), run_check=False)
        local = tc.local_tensor(dt)
        assert type(local) is torch.Tensor and torch.equal(local, t)
        assert local.data_ptr() == t.data_ptr()


# --------------------------------------------------------------- redistribution planner


def test_mesh_topo_info_and_transition_cost(mesh: Any) -> None:
    with api("torch.distributed.tensor._collective_utils.MeshTopoInfo / "
             "_compute_placement_transition_cost"):
        topo = tc.MeshTopoInfo.build_from_mesh(mesh)
        assert {"mesh_dim_devices", "mesh_dim_bandwidth", "mesh_dim_latency"} <= fields(
            tc.MeshTopoInfo)
        assert list(topo.mesh_dim_devices) == [2, 4]
        gather = tc.placement_transition_cost(Shard(0), Replicate(), topo, 0, 1.0)
        assert isinstance(gather, float) and 0 < gather < float("inf")
        assert tc.placement_transition_cost(Shard(0), Shard(0), topo, 0, 1.0) == 0.0


def test_noisy_logger_names() -> None:
    for name in tc.NOISY_LOGGERS:
        with api(f"logger {name}"):
            module = importlib.import_module(name)
            loggers = [v for v in vars(module).values() if isinstance(v, logging.Logger)]
            assert any(lg.name == name for lg in loggers)


def test_shard_dim_alltoall_frame() -> None:
    with api("torch.distributed.tensor._collective_utils.shard_dim_alltoall"):
        cu = importlib.import_module("torch.distributed.tensor._collective_utils")
        code = cu.shard_dim_alltoall.__code__
        assert code.co_name == "shard_dim_alltoall"
        assert code.co_filename.endswith("_collective_utils.py")
        assert not tc.inside_shard_dim_alltoall(sys._getframe())


# --------------------------------------------------------------------------- tracing


def test_fake_store() -> None:
    import torch.distributed as dist

    with api("torch.testing._internal.distributed.fake_pg.FakeStore"):
        assert isinstance(tc.fake_store(), dist.Store)
        assert "fake" in dist.Backend.backend_list


class _Loss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


@pytest.fixture(scope="module")
def joint() -> list[tuple[str, Any, Any]]:
    """``(op, desc, partitioner_tag)`` of each node of a tiny joint graph (read while the
    export's contexts are open; they are closed before the tests run)."""
    with contextlib.ExitStack() as stack:
        graph = tc.aot_export_joint_with_descriptors(stack, _Loss(), (torch.randn(2, 4),))
        return [(n.op, n.meta.get("desc"), n.meta.get("partitioner_tag"))
                for n in graph.graph_module.graph.nodes]


def test_aot_export_joint_with_descriptors(joint: list) -> None:
    from torch._functorch import aot_autograd

    with api("torch._functorch.aot_autograd.aot_export_joint_with_descriptors"):
        assert params(aot_autograd.aot_export_joint_with_descriptors)[:3] == [
            "stack", "mod", "args"]
        assert any(tag == "is_backward" for _, _, tag in joint)


def test_aot_descriptors(joint: list) -> None:
    with api("torch._functorch._aot_autograd.descriptors"):
        assert "target" in fields(tc.ParamAOTInput) and "target" in fields(tc.BufferAOTInput)
        assert "idx" in fields(tc.PlainAOTInput) and "grad_of" in fields(tc.GradAOTOutput)
        assert "output" in fields(tc.TangentAOTInput) and "idx" in fields(tc.PlainAOTOutput)
        inputs = {type(desc) for op, desc, _ in joint if op == "placeholder"}
        assert {tc.ParamAOTInput, tc.PlainAOTInput} <= inputs
        outs = next(desc for op, desc, _ in joint if op == "output")
        assert type(outs[0]) is tc.PlainAOTOutput
        grads = {d.grad_of.target for d in outs if type(d) is tc.GradAOTOutput}
        assert grads == {"lin.weight", "lin.bias"}


def test_export_tracing_state() -> None:
    with api("torch.compiler._is_compiling_flag / _is_exporting_flag"):
        assert not torch.compiler.is_compiling() and not torch.compiler.is_exporting()
        with tc.export_tracing_state():
            assert torch.compiler.is_compiling() and torch.compiler.is_exporting()
        assert not torch.compiler.is_compiling() and not torch.compiler.is_exporting()


def test_reparametrize_module() -> None:
    with api("torch.nn.utils.stateless._reparametrize_module"):
        lin = torch.nn.Linear(2, 2)
        zeros = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
        with tc.reparametrize_module(lin, zeros, strict=False):
            assert torch.equal(lin(torch.ones(1, 2)), torch.zeros(1, 2))
        assert lin.weight.abs().sum() > 0


def test_c10d_collective_ops() -> None:
    with api("torch.distributed.tensor.debug._comm_mode.c10d_collective_ops"):
        ops = tc.C10D_COLLECTIVE_OPS
        assert torch.ops.c10d._allgather_base_ in ops
        assert torch.ops.c10d._reduce_scatter_base_ in ops and torch.ops.c10d.allreduce_ in ops


def test_process_group_lookups(tmp_path) -> None:
    """One real gloo process group: its name resolves to it, and the boxed object a c10d
    op receives unboxes to the same name."""
    import torch.distributed as dist

    with api("distributed_c10d._resolve_process_group / ProcessGroup.unbox"):
        started = not dist.is_initialized()
        if started:
            dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                                    world_size=1)
        try:
            group = dist.new_group([0])
            assert tc.resolve_process_group(group.group_name) is not None
            assert dist.get_process_group_ranks(
                tc.resolve_process_group(group.group_name)) == [0]
            assert tc.resolve_process_group("no-such-group") is None
            assert tc.process_group_name(group.boxed()) == group.group_name
        finally:
            if started:
                dist.destroy_process_group()


def test_allow_implicit_replication() -> None:
    with api("DTensor._op_dispatcher._allow_implicit_replication"):
        before = DTensor._op_dispatcher._allow_implicit_replication
        try:
            tc.allow_implicit_replication(True)
            assert DTensor._op_dispatcher._allow_implicit_replication is True
            tc.allow_implicit_replication(False)
            assert DTensor._op_dispatcher._allow_implicit_replication is False
        finally:
            DTensor._op_dispatcher._allow_implicit_replication = before
