"""Every private torch API the project uses, reached through one module (torch 2.13).

The planner re-implements parts of DTensor and drives its strategy functions directly,
so it depends on torch internals that carry no compatibility promise. Each of them is
named here once, with the public alternative or why there is none and where torch 2.13
defines it (paths under ``torch/``); the rest of ``pipeline/`` imports them from this
module. A name that a torch upgrade removes fails the import of this module with a
:class:`TorchAPIError` naming it (two exceptions: ``_NormPartial`` is optional, None when
gone, and the joint export is looked up at its first call, its module taking seconds to
import); tests/test_torch_compat.py checks, API by API, that each still exists and
behaves as used (signatures, fields, one small real call).

Left outside: ``pipeline/core/ir.py`` reads ``torch._ops.OpOverloadPacket`` and an
overload's ``_schema`` itself, because the core layer may not import this (higher)
layer; the test module checks both APIs all the same. The aten ops whose names start
with ``_`` (``aten._scaled_dot_product_flash_attention``) are operators, not Python
internals, and are called through ``torch.ops`` where they are used.

Sections: errors; operator objects and the dispatcher; DTensor placements, specs and
strategies; DTensor's redistribution internals; tracing (fake process group, joint
export, its descriptors, the export flags, reparametrization).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.library
from torch.distributed.tensor import DTensor

__all__ = [
    "BufferAOTInput",
    "C10D_COLLECTIVE_OPS",
    "C_PARTIAL",
    "C_REPLICATE",
    "C_SHARD",
    "C_STRIDED_SHARD",
    "DTensorSpec",
    "GradAOTOutput",
    "HigherOrderOperator",
    "MaskBuffer",
    "MaskPartial",
    "MeshTopoInfo",
    "NOISY_LOGGERS",
    "NormPartial",
    "OpOverload",
    "OpOverloadPacket",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "ParamAOTInput",
    "PlainAOTInput",
    "PlainAOTOutput",
    "STRATEGY_REJECTIONS",
    "Rejection",
    "ShardingPlaceholder",
    "StrategyFunctionError",
    "StridedShard",
    "StridedShardNotDecodableError",
    "TangentAOTInput",
    "TensorMeta",
    "TorchAPIError",
    "TupleStrategy",
    "allow_implicit_replication",
    "aot_export_joint_with_descriptors",
    "decomposition",
    "default_shard_order",
    "export_tracing_state",
    "fake_store",
    "has_kernel_for_dispatch_key",
    "impl_library",
    "inside_shard_dim_alltoall",
    "local_tensor",
    "meta_grouped_mm",
    "normalize_strided_shard_order",
    "op_name_parts",
    "op_schema",
    "op_schema_info",
    "op_strategy_func",
    "placement_transition_cost",
    "process_group_name",
    "qualified_op_name",
    "reparametrize_module",
    "resolve_process_group",
    "sharding_propagator",
    "single_dim_strategy_func",
    "strategy_rejection",
    "zero_redistribute_costs",
]


# --------------------------------------------------------------------------- errors


class TorchAPIError(RuntimeError):
    """A private torch API this project uses is gone or behaves unlike torch 2.13; the
    message (one line) names the API and this module."""


class StrategyFunctionError(TorchAPIError):
    """A DTensor strategy function failed in a way that is not how DTensor rejects a
    placement (:data:`STRATEGY_REJECTIONS`); the message names the op and the original
    exception (chained as ``__cause__``)."""

    @classmethod
    def of(cls, op: Any, err: BaseException) -> StrategyFunctionError:
        """The error for ``op``'s strategy function having raised ``err``."""
        first = str(err).splitlines()[0] if str(err) else ""
        return cls(f"{op}: DTensor's strategy function raised {type(err).__name__}: "
                   f"{first} (not how DTensor rejects a placement, STRATEGY_REJECTIONS in "
                   f"pipeline/dtensor/torch_compat.py; torch {torch.__version__})")


def _require(module: str, name: str) -> Any:
    """``module.name``; :class:`TorchAPIError` naming both when the torch in use has no
    such module or attribute."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise TorchAPIError(
            f"{module}.{name}: not in torch {torch.__version__} ({err}); "
            "pipeline/dtensor/torch_compat.py reaches it (written for torch 2.13)") from err


def _optional(module: str, name: str) -> Any:
    """``module.name``, None when the torch in use has no such module or attribute."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


_DT = "torch.distributed.tensor"
_OPS_UTILS = importlib.import_module(f"{_DT}._ops.utils")


# ------------------------------------------------------- operator objects, dispatcher

#: ``torch/_ops.py:806``. No public alias: ``torch.library`` documents and imports it
#: from ``torch._ops`` itself (``torch/library.py:24``).
OpOverload = _require("torch._ops", "OpOverload")
#: ``torch/_ops.py:1166`` (``torch.ops.aten.mm``); no public alias.
OpOverloadPacket = _require("torch._ops", "OpOverloadPacket")
#: ``torch/_ops.py:277`` (``cond``, ``while_loop``, ...); no public alias.
HigherOrderOperator = _require("torch._ops", "HigherOrderOperator")


def op_schema(op: Any) -> Any:
    """The ``torch._C.FunctionSchema`` of an ``OpOverload`` (``op._schema``,
    ``torch/_ops.py:818``). No public accessor exists; ``torch.library`` and the
    dispatcher read the same attribute."""
    return op._schema


def op_name_parts(op: Any) -> tuple[str, str, str]:
    """``(namespace, op name, overload name)`` of an ``OpOverload``, ``("aten", "mm",
    "default")``. ``op.namespace`` is public; the other two are the cached properties
    ``_opname`` and ``_overloadname`` (``torch/_ops.py:821, 856``), which ``repr(op)``
    prints but no public attribute holds."""
    return op.namespace, op._opname, op._overloadname


def qualified_op_name(packet: Any) -> str:
    """``"namespace::name"`` of an ``OpOverloadPacket`` (``_qualified_op_name``,
    ``torch/_ops.py:1178``); ``str(packet)`` spells it with a dot, no attribute holds it
    publicly."""
    return packet._qualified_op_name


def has_kernel_for_dispatch_key(name: str, key: str) -> bool:
    """Whether the operator ``name`` (``"aten::mm"``) has a kernel registered for the
    dispatch key ``key`` (``torch._C._dispatch_has_kernel_for_dispatch_key``,
    ``torch/_C/__init__.pyi:1832``). No public query of the dispatcher's table exists."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, key))


_DECOMPOSITIONS = _require("torch._decomp", "decomposition_table")


def decomposition(op: Any) -> Any:
    """The Python decomposition torch registered for ``op``, or None
    (``torch._decomp.decomposition_table``, ``torch/_decomp/__init__.py:42``). The public
    ``torch.export.default_decompositions()`` is the core-aten subset, which lacks some
    (``_fused_rms_norm_backward``)."""
    return _DECOMPOSITIONS.get(op)


_GLOBAL_DECOMPOSITIONS = _require("torch._decomp", "global_decomposition_table")
_DISPATCH_KEY = torch._C.DispatchKey


def decomposed_overloads() -> list[Any]:
    """Every ``OpOverload`` torch registered a Python decomposition for, in every table
    (``torch._decomp.global_decomposition_table``, ``torch/_decomp/__init__.py:40``); no
    public listing exists."""
    seen: dict[Any, None] = {}
    for table in _GLOBAL_DECOMPOSITIONS.values():
        for op in table:
            if isinstance(op, OpOverload):
                seen.setdefault(op, None)
    return list(seen)


def python_kernel(op: Any, key: str) -> Any:
    """The Python kernel ``op`` holds for the dispatch key ``key`` (``OpOverload.py_kernels``,
    ``torch/_ops.py``: Python kernels the Python dispatcher prefers), or None."""
    return op.py_kernels.get(getattr(_DISPATCH_KEY, key))


def has_python_kernel(op: Any, keys: tuple[str, ...]) -> bool:
    """Whether ``op`` holds a Python kernel for any of ``keys``."""
    return any(getattr(_DISPATCH_KEY, k) in op.py_kernels for k in keys)


def set_python_kernel(op: Any, key: str, kernel: Any) -> None:
    """Install (``kernel``) or remove (None) ``op``'s Python kernel for ``key`` and clear
    its dispatch cache (``OpOverload._dispatch_cache``), so the change takes effect."""
    k = getattr(_DISPATCH_KEY, key)
    if kernel is None:
        op.py_kernels.pop(k, None)
    else:
        op.py_kernels.setdefault(k, kernel)
    op._dispatch_cache.clear()


#: torch's meta kernel of ``aten._grouped_mm`` (``torch/_meta_registrations.py:8830``);
#: no public handle to a single op's meta kernel exists.
meta_grouped_mm = _require("torch._meta_registrations", "meta_grouped_mm")


@contextlib.contextmanager
def impl_library(namespace: str) -> Iterator[Any]:
    """A ``torch.library.Library(namespace, "IMPL")`` for the block, its registrations
    removed on exit with ``Library._destroy`` (``torch/library.py:601``). A ``Library`` is
    public; the only public removal is its finalizer at garbage collection
    (``weakref.finalize``, ``torch/library.py:255``), which happens at no set time;
    ``torch.library._scoped_library`` (``torch/library.py:671``) does the same and is
    private too."""
    lib = torch.library.Library(namespace, "IMPL")
    try:
        yield lib
    finally:
        lib._destroy()


# ------------------------------------------------- DTensor placements, specs, strategies

#: ``torch/distributed/tensor/placement_types.py:799``: a shard of a shard (the
#: sharding that follows ``view`` / ``reshape`` of a sharded dim); not public.
StridedShard = _require(f"{_DT}.placement_types", "_StridedShard")
#: ``torch/distributed/tensor/placement_types.py:1624``: the partial of a masked
#: (row-wise) embedding lookup; not public.
MaskPartial = _require(f"{_DT}.placement_types", "_MaskPartial")
#: The mask buffer a :data:`MaskPartial` shares with its producer
#: (``torch/distributed/tensor/_ops/_mask_buffer.py:9``, imported by placement_types).
MaskBuffer = _require(f"{_DT}.placement_types", "MaskBuffer")
#: ``torch/distributed/tensor/_ops/_math_ops.py:67``: a partial p-norm; not public.
#: None in a torch without it (the notation then refuses ``NP(p)``).
NormPartial = _optional(f"{_DT}._ops._math_ops", "_NormPartial")
#: The C++ base classes of DTensor's placements (``torch._C._distributed``, bound in
#: ``torch/distributed/tensor/placement_types.py:162, 799, 1429, 1494``); matching on
#: them also covers raw C++ placements. The public Python classes subclass them.
C_SHARD = torch._C._distributed.Shard
C_STRIDED_SHARD = torch._C._distributed.StridedShard
C_REPLICATE = torch._C._distributed.Replicate
C_PARTIAL = torch._C._distributed.Partial

#: ``torch/distributed/tensor/_dtensor_spec.py:67`` (shape, stride, dtype); not public.
TensorMeta = _require(f"{_DT}._dtensor_spec", "TensorMeta")
#: ``torch/distributed/tensor/_dtensor_spec.py:78``: mesh, placements, tensor meta. A
#: public DTensor needs a real tensor; sharding propagation works on specs.
DTensorSpec = _require(f"{_DT}._dtensor_spec", "DTensorSpec")
#: ``torch/distributed/tensor/_dtensor_spec.py:26`` (a ``ValueError``).
StridedShardNotDecodableError = _require(f"{_DT}._dtensor_spec",
                                         "_StridedShardNotDecodableError")
#: ``torch/distributed/tensor/_op_schema.py:367, 96, 225, 281``: the arguments a
#: strategy function takes and the strategies it returns. Public only through
#: ``torch.distributed.tensor.experimental.register_sharding``, which registers rules
#: and cannot enumerate them.
OpSchema = _require(f"{_DT}._op_schema", "OpSchema")
OpSpec = _require(f"{_DT}._op_schema", "OpSpec")
OpStrategy = _require(f"{_DT}._op_schema", "OpStrategy")
TupleStrategy = _require(f"{_DT}._op_schema", "TupleStrategy")
#: ``torch/distributed/tensor/_ops/single_dim_strategy.py:47``: "some Shard(d)" in a
#: single-dim rule; not public.
ShardingPlaceholder = _require(f"{_DT}._ops.single_dim_strategy", "_ShardingPlaceholder")


def sharding_propagator() -> Any:
    """DTensor's ``ShardingPropagator``, which holds every registered strategy function
    (``DTensor._op_dispatcher.sharding_propagator``: ``torch/distributed/tensor/_api.py:317``,
    ``_dispatch.py:176``). No public handle exists: DTensor runs it per call only."""
    return DTensor._op_dispatcher.sharding_propagator


def single_dim_strategy_func(op: Any) -> Any:
    """The single-mesh-dim strategy function of ``op`` (``func(op, args_meta,
    kwargs_meta)`` -> lists of placements per mesh dim), or None
    (``op_single_dim_strategy_funcs[op].func``, ``torch/distributed/tensor/_sharding_prop.py:375``,
    ``_ops/single_dim_strategy.py:74``). Not public."""
    info = sharding_propagator().op_single_dim_strategy_funcs.get(op)
    return None if info is None else info.func


def op_strategy_func(op: Any) -> Any:
    """The full strategy function of ``op`` (``func(OpSchema)`` -> ``OpStrategy`` /
    ``TupleStrategy``), or None (``op_strategy_funcs``,
    ``torch/distributed/tensor/_sharding_prop.py:371``). Not public."""
    return sharding_propagator().op_strategy_funcs.get(op)


def op_schema_info(op: Any) -> Any:
    """``RuntimeSchemaInfo`` of ``op`` (its static arguments), or None
    (``op_to_schema_info``, ``torch/distributed/tensor/_sharding_prop.py:381``)."""
    return sharding_propagator().op_to_schema_info.get(op)


class Rejection(NamedTuple):
    """One way a DTensor strategy function refuses the input placements offered.

    Attributes:
        kind: the exception class (subclasses included).
        raised_in: the module file, relative to ``torch/distributed/tensor/``, whose code
            raises it (the innermost frame of the traceback), or ``""`` for any module of
            that package.
        every_candidate: only in the call that offers every candidate of every argument
            at once (arguments offering different numbers of placements).
        where: torch 2.13 sites and what they refuse.
    """

    kind: type[Exception]
    raised_in: str
    every_candidate: bool
    where: str


#: How DTensor's full strategy functions reject input placements (torch 2.13; read off
#: ``torch/distributed/tensor/_ops/``, ``_op_schema.py``, ``_dtensor_spec.py`` and
#: observed enumerating the toy, LLaMA and tiny transformers models on 1-3-d meshes).
#: No strategy function raises ``NotImplementedError`` (only ``_sharding_prop.py:1041``,
#: for an op without one); a ``TypeError`` or ``AttributeError``, or a ``KeyError`` /
#: ``IndexError`` anywhere else, means an API changed: :class:`StrategyFunctionError`.
STRATEGY_REJECTIONS: tuple[Rejection, ...] = (
    Rejection(RuntimeError, "", False,
              "a sharding the op cannot keep: _ops/_tensor_ops.py:1506 unbind along a sharded "
              "dim; _ops/_view_ops.py:811, 947, 1019, 1043, 1278, 1343 views of uneven or "
              "split shards; _ops/_common_rules.py:94 conflicting einsum shardings; "
              "_ops/utils.py:670 an in-place op's placement"),
    Rejection(ValueError, "", False,
              "_ops/_math_ops.py:1029 an uneven nll_loss mean; _ops/_tensor_ops.py:921 "
              "arguments on other meshes; the spec checks of _dtensor_spec.py "
              "(_StridedShardNotDecodableError included)"),
    Rejection(AssertionError, "", False,
              "the raise AssertionError argument checks, e.g. _ops/_tensor_ops.py:1014, "
              "1058 cat of unlike inputs"),
    Rejection(KeyError, "_ops/_view_ops.py", False,
              "_ops/_view_ops.py:1202 (_rewrite_plain_shard): a Shard of an input dim the "
              "view maps to no output dim (expand of a size-1 dim)"),
    Rejection(IndexError, "_ops/_math_ops.py", True,
              "_ops/_math_ops.py:989, 1121 nll_loss_forward / nll_loss_backward index the "
              "target's strategies by the input's"),
)

_DT_DIR = Path(importlib.import_module(_DT).__file__).parent


def strategy_rejection(err: BaseException, every_candidate: bool) -> bool:
    """Whether ``err``, raised by a DTensor strategy function, is its refusal of the
    placements offered (one of :data:`STRATEGY_REJECTIONS`); ``every_candidate``: the
    call offered every candidate of every argument at once."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    raised_in = None if tb is None else Path(tb.tb_frame.f_code.co_filename)
    for r in STRATEGY_REJECTIONS:
        if not isinstance(err, r.kind) or (r.every_candidate and not every_candidate):
            continue
        if raised_in is not None and raised_in.is_relative_to(_DT_DIR) and (
                not r.raised_in or raised_in == _DT_DIR / r.raised_in):
            return True
    return False


def _zero_costs(src_strategy: Any, dst_spec: Any) -> list[float]:
    """``generate_redistribute_costs`` answering zeros (one per source strategy)."""
    return [0.0] * len(src_strategy.strategies)


@contextlib.contextmanager
def zero_redistribute_costs() -> Iterator[list[str]]:
    """DTensor's ``generate_redistribute_costs`` answering zeros inside the block.

    Strategy functions fill ``OpSpec.redistribute_cost`` with it
    (``torch/distributed/tensor/_ops/utils.py:376``) for every (candidate input,
    strategy) pair: quadratic in the candidates and >95% of enumeration time. The
    project costs redistributions itself (pipeline/costmodel), and the set of strategies
    does not depend on these rows. The strategy modules bind the name at import
    (``from ..utils import generate_redistribute_costs``), so every loaded
    ``torch.distributed.tensor*`` module holding DTensor's function gets the zeros, and
    exactly those get it back on exit. There is no public switch.

    Yields the names of the modules patched.

    Raises:
        TorchAPIError: ``torch.distributed.tensor._ops.utils`` has no
            ``generate_redistribute_costs``.
    """
    name = "generate_redistribute_costs"
    original = getattr(_OPS_UTILS, name, None)
    if original is None:
        raise TorchAPIError(f"{_OPS_UTILS.__name__}.{name}: not in torch {torch.__version__}; "
                            "pipeline/dtensor/torch_compat.py zero_redistribute_costs "
                            "patches it (written for torch 2.13)")
    patched = [(key, m) for key, m in list(sys.modules.items())
               if key.startswith(_DT) and m is not None and getattr(m, name, None) is original]
    for _, m in patched:
        setattr(m, name, _zero_costs)
    try:
        yield [key for key, _ in patched]
    finally:
        for _, m in patched:
            setattr(m, name, original)


def local_tensor(t: Any) -> Any:
    """The local shard of a DTensor as stored (``DTensor._local_tensor``,
    ``torch/distributed/tensor/_api.py:312``). The public ``to_local()`` returns it
    only with autograd off; with autograd on it adds a ``_ToTorchTensor`` node
    (``_api.py:604``), which the plan's step functions do not want."""
    return t._local_tensor


#: ``torch/distributed/tensor/debug/_comm_mode.py:44``: the ``c10d`` collective ops
#: ``CommDebugMode`` counts besides its functional ones (FSDP2 issues these); not public.
C10D_COLLECTIVE_OPS = _require("torch.distributed.tensor.debug._comm_mode",
                               "c10d_collective_ops")
def allow_implicit_replication(on: bool = True) -> None:
    """Let DTensor ops take plain tensors as replicated, in forward *and* backward (the
    public ``torch.distributed.tensor.experimental.implicit_replication`` is a context
    manager, which a backward run later, by the caller, is outside of; it sets
    ``DTensor._op_dispatcher._allow_implicit_replication``, ``torch/distributed/tensor/
    experimental/__init__.py:24``)."""
    DTensor._op_dispatcher._allow_implicit_replication = bool(on)


_RESOLVE_GROUP = _require("torch.distributed.distributed_c10d", "_resolve_process_group")


def resolve_process_group(group_name: str) -> Any:
    """The process group of a functional collective's ``group_name`` argument, or None
    (``torch.distributed.distributed_c10d._resolve_process_group``, from
    ``torch._C._distributed_c10d``; no public lookup by name)."""
    try:
        return _RESOLVE_GROUP(group_name)
    except (RuntimeError, ValueError, KeyError):
        return None


def process_group_name(boxed: Any) -> str:
    """The name of the process group a ``c10d`` op receives (a ``torch.ScriptObject``
    boxing it, as FSDP2's ``dist.all_gather_into_tensor`` passes it):
    ``ProcessGroup.unbox(boxed).group_name``."""
    import torch.distributed as dist

    return dist.ProcessGroup.unbox(boxed).group_name


# ------------------------------------------------------- DTensor's redistribution planner

#: ``torch/distributed/tensor/_collective_utils.py:311``: DTensor's mesh bandwidth and
#: latency model (``build_from_mesh``); not public.
MeshTopoInfo = _require(f"{_DT}._collective_utils", "MeshTopoInfo")
_TRANSITION_COST = _require(f"{_DT}._collective_utils", "_compute_placement_transition_cost")


def placement_transition_cost(src: Any, dst: Any, topo: Any, mesh_dim: int,
                              comm_bytes_gb: float) -> float:
    """DTensor's cost of one redistribution step ``src -> dst`` on ``mesh_dim``
    (``_compute_placement_transition_cost(...)[0]``,
    ``torch/distributed/tensor/_collective_utils.py:391``), the step cost of its graph
    planner. The public ``redistribute_cost`` prices whole specs, not one step."""
    return _TRANSITION_COST(src, dst, topo, mesh_dim, comm_bytes_gb)[0]


def normalize_strided_shard_order(placements: tuple, mesh: Any) -> tuple[tuple, Any]:
    """``(placements with each _StridedShard a Shard, shard order)`` as DTensor's graph
    planner decodes them (``DTensorSpec._normalize_placements_into_shard_order(...,
    True)``, ``torch/distributed/tensor/_dtensor_spec.py:128``). Not public.

    Raises:
        StridedShardNotDecodableError: no shard order gives these placements.
    """
    return DTensorSpec._normalize_placements_into_shard_order(placements, mesh, True)


def default_shard_order(placements: tuple) -> Any:
    """The left-to-right shard order of ``placements``
    (``DTensorSpec.compute_default_shard_order``,
    ``torch/distributed/tensor/_dtensor_spec.py:156``); on the private spec class."""
    return DTensorSpec.compute_default_shard_order(placements)


#: Loggers of torch internals that warn once per redistribution / recompile in a verify
#: worker (``torch/distributed/tensor/_redistribute.py:41``,
#: ``torch/_logging/_internal.py:34``); the names are their private modules'.
NOISY_LOGGERS: tuple[str, ...] = (f"{_DT}._redistribute", "torch._logging._internal")


def inside_shard_dim_alltoall(frame: Any) -> bool:
    """Whether DTensor's CPU all-to-all (an all-gather plus a local chunk,
    ``shard_dim_alltoall`` in ``torch/distributed/tensor/_collective_utils.py:82``) is
    on the call stack from ``frame`` outwards. Nothing public tells the gather of an
    all-to-all from a plain all-gather."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "shard_dim_alltoall" and code.co_filename.endswith(
                "_collective_utils.py"):
            return True
        frame = frame.f_back
    return False


# --------------------------------------------------------------------------- tracing


_FAKE_STORE = _require("torch.testing._internal.distributed.fake_pg", "FakeStore")


def fake_store() -> Any:
    """A ``FakeStore`` for ``init_process_group("fake", ...)``: a process group whose
    collectives do nothing, so DeviceMesh and DTensor run without devices
    (``torch/testing/_internal/distributed/fake_pg.py:7``; importing that module
    registers the ``fake`` backend). torch has no public fake process group."""
    return _FAKE_STORE()


def aot_export_joint_with_descriptors(stack: Any, module: Any, args: tuple) -> Any:
    """The joint forward + backward graph of ``module(*args)`` with input / output
    descriptors (``torch._functorch.aot_autograd.aot_export_joint_with_descriptors``,
    ``torch/_functorch/aot_autograd.py:1308``); valid while ``stack`` is open. The public
    ``torch.export`` exports the forward only. Its module is imported on the first call:
    the import takes seconds and only the trace stage traces."""
    func = _require("torch._functorch.aot_autograd", "aot_export_joint_with_descriptors")
    return func(stack, module, args)


_DESCRIPTORS = "torch._functorch._aot_autograd.descriptors"
#: The descriptors of a joint graph's placeholders and outputs (``node.meta["desc"]``,
#: ``torch/_functorch/_aot_autograd/descriptors.py:382, 398, 428, 575, 601, 645``):
#: a parameter / buffer (field ``target``), a plain input (``idx``), a tangent, the
#: plain output and a gradient (``grad_of``). Not public.
ParamAOTInput = _require(_DESCRIPTORS, "ParamAOTInput")
BufferAOTInput = _require(_DESCRIPTORS, "BufferAOTInput")
PlainAOTInput = _require(_DESCRIPTORS, "PlainAOTInput")
TangentAOTInput = _require(_DESCRIPTORS, "TangentAOTInput")
PlainAOTOutput = _require(_DESCRIPTORS, "PlainAOTOutput")
GradAOTOutput = _require(_DESCRIPTORS, "GradAOTOutput")


@contextlib.contextmanager
def export_tracing_state() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` and ``is_exporting()`` true in the block, as
    during torch.export's own capture (``torch._export.utils._compiling_state_context``,
    ``torch/_export/utils.py:1442``, sets the same two module flags
    ``torch/compiler/__init__.py:472-473``): libraries that branch on them
    (transformers' ``is_tracing()``) take their traceable paths. The flags are restored
    on exit. The public ``torch.compiler`` only reads them."""
    old = (torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag)
    torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = old


_REPARAMETRIZE = _require("torch.nn.utils.stateless", "_reparametrize_module")


def reparametrize_module(module: Any, tensors: dict[str, Any], strict: bool = False) -> Any:
    """A context in which ``module``'s parameters and buffers named in ``tensors`` are
    those tensors (``torch.nn.utils.stateless._reparametrize_module``,
    ``torch/nn/utils/stateless.py:99``). The public ``torch.func.functional_call``
    wraps it but calls ``module.forward`` itself; the training step runs its own
    function around the forward inside the context."""
    return _REPARAMETRIZE(module, tensors, strict=strict)
