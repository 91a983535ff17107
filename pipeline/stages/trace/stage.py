"""Stage 1 - trace: the joint forward + loss + backward graph as a Parquet IR.

The model is built on the meta device, a fake process group sized to the
mesh is initialised (``torch.distributed`` "fake" backend, no GPU), and the
training step is captured with ``aot_export_joint_with_descriptors`` on the
module itself (torch 2.13's joint export), module paths being recorded through
forward hooks (:func:`module_path_annotations`). The joint
graph holds aten ops (and any custom ops the model calls, named
``namespace.op.overload``); AOT descriptors identify parameters, buffers,
plain inputs, tangents, the loss output and gradient outputs.

The model comes from its family's builder (:mod:`pipeline.models`: the built-in LLaMA,
a transformers architecture, a module of your own); :mod:`pipeline.models.step` gives
the capture one placeholder per parameter *tensor* (tied parameters), the mixed-precision
casts and the loss. The capture runs in the state torch.export sets during its own
capture (``torch.compiler.is_compiling()`` and ``is_exporting()`` true,
:func:`pipeline.dtensor.torch_compat.export_tracing_state`), which is what
transformers' ``is_tracing()`` looks for: without it transformers takes eager-only,
data-dependent paths (``find_packed_sequence_indices``) that cannot be traced on meta.
Composite ops whose Python meta kernel would cost them their derivative on meta tensors
(``aten::nll_loss`` of ``F.cross_entropy``) dispatch as on CPU during the capture
(:mod:`pipeline.stages.trace.composite`: why, and which ops). A capture in which a
trainable parameter still gets no gradient (an op without a derivative on the way to the
loss, an unused parameter) is refused with one line naming the parameter.

**Depth-independent trace** (``stamp_layers``, default on; :mod:`pipeline.stages.trace.stamp`):
a model of N >= 5 repeated blocks (one ``ModuleList``) whose blocks are structurally
identical (modules, tensors, plain attributes except the layer index) is traced with its
first 4 blocks (first, two middles, last) and the middle block is stamped into the IR up
to N blocks; the result is the table a full trace writes, row for row. The 4-block IR
must prove it: the blocks' nodes in relative form (block paths index-free, tensor
references as (block offset, ordinal in the block)) equal, the middles exactly and the
first / last block up to their references outside the blocks; the layer labels one run
per block in ascending or descending sweeps; nodes outside the blocks referring to the
first and last block only (the output node's gradient list is a sweep of its own); FX
name counters advancing alike in both middles; and stamping the 4-block IR back to 4
blocks reproducing it. Otherwise, or with ``stamp_layers=false``, the whole model is
traced. Residual risk: forward code branching on the layer index itself beyond block 3
(or reading ``len()`` of the block list) escapes both the structural and the IR checks;
``stamp_layers=false`` avoids it.

The graph's metadata (``pipeline`` key of the Parquet schema) holds the model facts of
the run record: ``model_info`` = family, architecture, parameter count (distinct
tensors), layer count (repeated blocks found in the graph), width when known, and
``tied_parameters`` ``{alias: parameter}``, and ``trace_method``: ``{"stamped": true,
"traced_layers": 4}`` or ``{"stamped": false, "why": ...}``.

Graph IR (``graph.parquet``), one row per FX node in graph order:

=============  ===========================================================
column         meaning
=============  ===========================================================
idx            position in graph order (int32)
name           FX node name
kind           placeholder | call_function | output
target         ``aten.mm.default``, ``getitem``, or the placeholder name
args, kwargs   JSON; node references are ``{"node": idx}``
outputs        JSON list, one entry per output element: ``{"shape", "dtype",
               "stride"}`` or null for a non-tensor element
tuple_output   the op returns a tuple (elements selected by ``getitem``)
role           param | buffer | input | tangent | activation | output
fqn            parameter / buffer fully-qualified name (module path)
input_index    position of a plain model input
module_path    innermost module path of the (forward) op, e.g. layers.3.attention
layer          module path of the repeated block holding the node, e.g. layers.3
phase          fwd | bwd
output_desc    JSON, output node only: per element ``{"kind": "loss"|"grad"|"none",
               "grad_of": fqn}``
=============  ===========================================================

The IR is read back (torch-free) by :mod:`pipeline.core.ir`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.core import runtime
from pipeline.core.artifacts import GRAPH_FILE
from pipeline.core.ir import tagged, tensor_ref
from pipeline.stages.trace.composite import composite_autograd_on_meta
from pipeline.stages.trace.layers import layer_of_path, module_path_of_stack

log = logging.getLogger(__name__)

def fake_process_group(world_size: int) -> None:
    """Initialise (once per process) a fake process group of ``world_size`` ranks.

    Uses ``FakeStore`` (:func:`pipeline.dtensor.torch_compat.fake_store`); collectives
    are no-ops, so DeviceMesh and DTensor work without devices.
    Raises RuntimeError if a real process group of another size exists.
    """
    import torch.distributed as dist

    from pipeline.dtensor.torch_compat import fake_store

    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            dist.destroy_process_group()
        else:
            return
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)


def _encode(arg: Any, index: dict[Any, int]) -> Any:
    """An FX argument in the IR's JSON form (the conventions of :mod:`pipeline.core.ir`)."""
    import torch
    import torch.fx as fx

    if isinstance(arg, fx.Node):
        return tensor_ref(index[arg])
    if isinstance(arg, (list, tuple)):
        return [_encode(a, index) for a in arg]
    if isinstance(arg, dict):
        return {str(k): _encode(v, index) for k, v in arg.items()}
    if isinstance(arg, torch.dtype):
        return tagged("dtype", str(arg).replace("torch.", ""))
    if isinstance(arg, (torch.device, torch.layout, torch.memory_format)):
        return tagged("enum", str(arg))
    if isinstance(arg, float) and (arg != arg or arg in (float("inf"), float("-inf"))):
        return tagged("float", str(arg))
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return arg
    return tagged("repr", repr(arg))


def _tensor_meta(val: Any) -> dict | None:
    import torch

    if isinstance(val, torch.Tensor):
        return {"shape": [int(s) for s in val.shape], "dtype": str(val.dtype).replace("torch.", ""),
                "stride": [int(s) for s in val.stride()]}
    return None


def _outputs(val: Any) -> tuple[list, bool]:
    if isinstance(val, (list, tuple)):
        return [_tensor_meta(v) for v in val], True
    return [_tensor_meta(val)], False


def _target_name(node: Any) -> str:
    if node.op == "placeholder":
        return "placeholder"
    if node.op == "output":
        return "output"
    t = node.target
    if getattr(t, "__name__", "") == "getitem":
        return "getitem"
    from pipeline.dtensor.torch_compat import OpOverload, op_name_parts

    if isinstance(t, OpOverload):
        # ``namespace.op.overload`` for every namespace (aten, transformers, a user's
        # torch.library op), never the Python module path of the op object.
        return ".".join(op_name_parts(t))
    name = str(t)
    return name if name.startswith("aten.") else f"{getattr(t, '__module__', '')}.{t}"


@contextlib.contextmanager
def module_path_annotations(model: Any) -> Iterator[None]:
    """Tag every traced node with the path of the innermost module running it.

    Forward pre/post hooks enter and leave ``torch.fx.traceback.annotate(
    {"module_path": name})``; under ``preserve_node_meta`` the tracer stores the
    annotation in ``node.meta["custom"]`` and AOT autograd copies it to the
    backward nodes of the same op. The hooks are removed on exit.
    """
    import functools

    import torch.fx.traceback as fxt

    open_annotations: list[Any] = []

    def enter(_mod: Any, _args: Any, name: str = "") -> None:
        cm = fxt.annotate({"module_path": name})
        cm.__enter__()
        open_annotations.append(cm)

    def leave(_mod: Any, _args: Any, _out: Any, name: str = "") -> None:
        open_annotations.pop().__exit__(None, None, None)

    handles = []
    for name, mod in model.named_modules():
        if name:
            handles.append(mod.register_forward_pre_hook(functools.partial(enter, name=name)))
            handles.append(mod.register_forward_hook(functools.partial(leave, name=name)))
    try:
        with fxt.preserve_node_meta():
            yield
    finally:
        for h in handles:
            h.remove()


def capture_joint_graph(model: Any, inputs: tuple, stack: contextlib.ExitStack) -> Any:
    """Capture the joint forward+backward FX graph of ``model(*inputs)`` (a scalar loss).

    ``aot_export_joint_with_descriptors`` traces the module directly (make_fx under
    a fake mode; no Dynamo graph capture, which took 2.5x longer for the same
    aten graph) with module paths recorded by :func:`module_path_annotations`, composite
    ops keeping their backward on meta (:func:`composite_autograd_on_meta`).
    Returns the ``torch.fx.GraphModule`` of the joint graph; valid while ``stack``
    is open.
    """
    from pipeline.dtensor.torch_compat import aot_export_joint_with_descriptors

    with module_path_annotations(model), composite_autograd_on_meta():
        joint = aot_export_joint_with_descriptors(stack, model, inputs)
    return joint.graph_module


def graph_to_table(graph_module: Any) -> pa.Table:
    """Convert a joint graph into the graph IR table (schema in the module docstring)."""
    from pipeline.dtensor.torch_compat import (
        BufferAOTInput,
        GradAOTOutput,
        ParamAOTInput,
        PlainAOTInput,
        PlainAOTOutput,
        TangentAOTInput,
    )

    nodes = list(graph_module.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    rows: dict[str, list] = {k: [] for k in (
        "idx", "name", "kind", "target", "args", "kwargs", "outputs", "tuple_output", "role",
        "fqn", "input_index", "module_path", "layer", "phase", "output_desc", "grad_acc")}
    for i, n in enumerate(nodes):
        desc = n.meta.get("desc")
        role, fqn, input_index, output_desc = "activation", None, None, None
        if n.op == "placeholder":
            kind = type(desc)
            if kind is ParamAOTInput:
                role, fqn = "param", desc.target
            elif kind is BufferAOTInput:
                role, fqn = "buffer", desc.target
            elif kind is PlainAOTInput:
                role, input_index = "input", int(desc.idx)
            elif kind is TangentAOTInput:
                role = "tangent"
            else:
                role = "input"
        elif n.op == "output":
            role = "output"
            descs = []
            for d in desc or []:
                if type(d) is PlainAOTOutput:
                    descs.append({"kind": "loss", "grad_of": None})
                elif type(d) is GradAOTOutput:
                    descs.append({"kind": "grad", "grad_of": getattr(d.grad_of, "target", None)})
                else:
                    descs.append({"kind": "none", "grad_of": None})
            output_desc = json.dumps(descs)
        custom = n.meta.get("custom") or {}
        stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack")
        if n.op != "call_function":
            mpath = fqn or ""
        elif custom.get("module_path"):
            mpath = str(custom["module_path"])
        else:
            mpath = module_path_of_stack(stack)
        phase = "bwd" if n.meta.get("partitioner_tag") == "is_backward" else "fwd"
        if n.op == "placeholder":
            phase = "bwd" if role == "tangent" else "fwd"
        outs, is_tuple = _outputs(n.meta.get("val")) if n.op != "output" else ([], False)
        rows["idx"].append(i)
        rows["name"].append(n.name)
        rows["kind"].append(n.op)
        rows["target"].append(_target_name(n))
        rows["args"].append(json.dumps(_encode(list(n.args), index)))
        rows["kwargs"].append(json.dumps(_encode(dict(n.kwargs), index)))
        rows["outputs"].append(json.dumps(outs))
        rows["tuple_output"].append(is_tuple)
        rows["role"].append(role)
        rows["fqn"].append(fqn)
        rows["input_index"].append(input_index)
        rows["module_path"].append(mpath)
        rows["layer"].append(layer_of_path(mpath))
        rows["phase"].append(phase)
        rows["output_desc"].append(output_desc)
        rows["grad_acc"].append(bool(n.meta.get("is_gradient_acc", False)))
    _inherit_layers(rows, nodes, index)
    return pa.table({
        "idx": pa.array(rows["idx"], pa.int32()),
        **{k: pa.array(rows[k]) for k in rows if k != "idx"},
    })


def _inherit_layers(rows: dict[str, list], nodes: list, index: dict) -> None:
    """Give gradient-accumulation adds (no module stack of their own) a layer.

    An accumulation add sums the gradient contributions of one forward tensor;
    it belongs to the block whose backward produced the newest contribution, so
    it takes the layer of its latest (graph order) layer-tagged input that is not
    itself an accumulation, falling back to accumulation inputs.
    """
    for i, n in enumerate(nodes):
        if n.op != "call_function" or rows["layer"][i] is not None or not rows["grad_acc"][i]:
            continue
        ins = sorted(index[a] for a in n.all_input_nodes)
        plain = [j for j in ins if rows["layer"][j] is not None and not rows["grad_acc"][j]]
        acc = [j for j in ins if rows["layer"][j] is not None and rows["grad_acc"][j]]
        pick = plain or acc
        if pick:
            rows["layer"][i] = rows["layer"][pick[-1]]


def check_gradients(graph_module: Any, trainable: set[str]) -> None:
    """Refuse a captured step in which a trainable parameter has no gradient output.

    torch only warns when the backward of a loss vanishes (an op without a derivative on
    the way to the loss: a ``torch.library`` op with no autograd formula): the graph then
    holds the forward alone and every gradient output is None; a loss that does not
    require grad at all (computed from detached tensors) gives an inference graph with no
    gradient outputs. A plan of either would be a forward-only plan. Parameters are
    named in placeholder order.

    Raises:
        ModelError: one line naming the first such parameter.
    """
    from pipeline.dtensor.torch_compat import GradAOTOutput, ParamAOTInput
    from pipeline.models import ModelError

    nodes = list(graph_module.graph.nodes)
    params = [n.meta["desc"].target for n in nodes if n.op == "placeholder"
              and type(n.meta.get("desc")) is ParamAOTInput]
    out = next(n for n in nodes if n.op == "output")
    flat = out.args[0] if out.args else []
    grads = {getattr(desc.grad_of, "target", None): value
             for value, desc in zip(flat, out.meta.get("desc") or [])
             if type(desc) is GradAOTOutput}
    missing = [name for name in params if name in trainable and grads.get(name) is None]
    if missing:
        raise ModelError(
            f"{missing[0]}: the captured training step has no gradient for this trainable "
            f"parameter ({len(missing)} of {len(trainable)} have none): the loss's backward "
            "vanished (an op on the way to the loss has no derivative: a torch.library op "
            "without an autograd formula, a detach) or the parameter is unused (set "
            "requires_grad=False on it)")


def _capture(built: Any) -> pa.Table:
    """Capture the training step of ``built`` and convert it to the graph IR."""
    from pipeline.dtensor.torch_compat import export_tracing_state
    from pipeline.models.step import training_step

    with contextlib.ExitStack() as stack:
        with training_step(built) as (module, _tied):
            trainable = {n for n, p in module.named_parameters() if p.requires_grad}
            with export_tracing_state():
                gm = capture_joint_graph(module, built.inputs, stack)
        check_gradients(gm, trainable)
        return graph_to_table(gm)


def trace_model(model_cfg: Any, world_size: int, stamp_layers: bool = True
                ) -> tuple[pa.Table, dict[str, Any]]:
    """Trace the training step of the model described by ``model_cfg``.

    With ``stamp_layers`` (the default) a model of N >= 5 identical repeated blocks is
    traced with its first 4 blocks and the IR stamped to N blocks
    (:mod:`pipeline.stages.trace.stamp`: method, proof conditions, residual risk), the same
    table a full trace gives; when the blocks are not provably identical, or without
    ``stamp_layers``, the whole model is traced.

    Returns the graph IR table and a dict of facts (node count, seconds, ``model_info``,
    ``tied_parameters``, ``method``: ``{"stamped": true, "traced_layers": 4}`` or
    ``{"stamped": false, "why": ...}``).

    Raises:
        ValueError: an invalid model config (:class:`pipeline.models.ModelError` for a
            model that cannot be built or whose step has no gradient).
    """
    from pipeline import models
    from pipeline.models.step import parameter_count, tied_parameters
    from pipeline.stages.trace import stamp as trace_stamp

    built = models.build(model_cfg)
    fake_process_group(world_size)
    start = time.perf_counter()
    tied = tied_parameters(built.module)
    params = parameter_count(built.module)
    plan, why = (trace_stamp.short_model_plan(built.module, tied) if stamp_layers
                 else (None, "stamp_layers=false"))
    table = None
    if plan is not None:
        trace_stamp.truncate_blocks(built.module, plan)
        try:
            short = _capture(built)
        except IndexError as err:
            # a forward that indexes the blocks up to the full depth cannot run truncated
            # (any other error is the model's own: the full trace would raise it too)
            why = f"the forward cannot run with {trace_stamp.SHORT_LAYERS} blocks ({err})"
        else:
            try:
                table = trace_stamp.stamp(short, plan.container, plan.n_layers)
                method = {"stamped": True, "traced_layers": trace_stamp.SHORT_LAYERS}
            except trace_stamp.StampError as err:
                why = f"the {trace_stamp.SHORT_LAYERS}-block trace does not prove it: {err}"
        if table is None:
            built = models.build(model_cfg)
    if table is None:
        method = {"stamped": False, "why": why}
        table = _capture(built)
    log.info("trace: %s", f"stamped {trace_stamp.SHORT_LAYERS} traced blocks to "
             f"{plan.n_layers}" if method["stamped"] else f"full trace ({why})")
    layers = {x for x, k in zip(table.column("layer").to_pylist(),
                                table.column("kind").to_pylist())
              if x is not None and k == "call_function"}
    info = {**built.info, "parameters": int(params), "layers": len(layers)}
    return table, {"nodes": table.num_rows, "seconds": time.perf_counter() - start,
                   "model_info": info, "tied_parameters": dict(tied), "method": method}


def world_size_of(cfg: Any) -> int:
    size = 1
    for s in cfg.mesh:
        size *= int(s)
    return size


def run_trace(cfg: Any, out_dir: Path) -> None:
    """Stage entry point: trace ``cfg.model`` and write ``out_dir/graph.parquet``.

    The IR does not depend on the mesh; the fake process group is sized to the
    mesh only so DTensor state exists for later in-process stages.
    """
    from omegaconf import OmegaConf

    timer = runtime.PhaseTimer()
    with timer.phase("trace"):
        model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
        table, facts = trace_model(model_cfg, world_size_of(cfg),
                                   stamp_layers=bool(cfg.get("stamp_layers", True)))
        # The traced FX graphs and the model are reference cycles (~3,000 objects per
        # layer): reclaim them here, in the stage that made them, rather than in the
        # first full collection of a later stage running in the same process.
        gc.collect()
    meta = {
        "stage": "trace",
        "model": model_cfg,
        "model_info": facts["model_info"],
        "tied_parameters": facts["tied_parameters"],
        "nodes": facts["nodes"],
        "trace_method": facts["method"],
        "seconds": timer.seconds,
        "peak_rss_bytes": runtime.peak_rss_bytes(),
        "git": runtime.git_revision(),
    }
    runtime.write_parquet(Path(out_dir) / GRAPH_FILE, table, metadata=meta)
    log.info("trace: %d nodes in %.2f s", facts["nodes"], timer.seconds["trace"])

