"""Reference side of the side-by-side benchmark: the public AutoParallel planner
(github.com/meta-pytorch/autoparallel at commit 8eda68d, its approximate-solver commit)
plans LLaMA-3 with the LLaMA-3.2 1B shapes of ``conf/model/llama1b.yaml`` and prints one
JSON line.

Runs inside the reference's own venv (``benchmarks/setup_reference.sh``), not with the
project's: it imports ``autoparallel`` and nothing of ``pipeline``.

What it does, as the reference's own example (``examples/example_llama3.py``) and its
tests do: a fake process group (``"fake"`` backend, world size = product of the mesh),
the model built on the meta device, ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``,
``repeated_subgraphs=True``, the parameter-memory bound ``(0, 1 / world)`` and the input
placement ``S(0)`` on the first mesh dim, ``R`` on the others (the project's defaults too;
outputs unconstrained unless ``--outputs``). The solver is chosen
the way ``autoparallel/api.py`` does it at this commit: ``AutoParallel(...,
solver="approx")`` builds the light optimizer (no PuLP variables) and
``optimize_placement()`` runs ``ApproximateShardingSolver`` (TRW-S, then local-search
polish) with its default options. Cost building uses the reference's default fork
workers (``AP_PARALLEL_BUILD``, default ``min(32, cpu_count)``).

Device: the reference's example and tests use a ``"cuda"`` mesh; a CPU-only torch build
cannot take ``cuda`` fake tensors through autograd, so the mesh is ``"cpu"`` and the
device queries are answered as for an H100 (the patches of the reference's
``tests/conftest.py``, plus ``torch.cpu.get_device_name``, which the compute model asks
on a CPU build): the cost model is the H100 / NCCL one a GPU run uses. The attention
calls ``aten._scaled_dot_product_flash_attention`` directly, as a GPU run traces it and
as the project's model does (``--attention cpu``: the model's own SDPA, which on a CPU
build traces the CPU kernel, a replicate-only op for the reference).

Mesh dim names: ``dp`` (1-D), ``dp,tp`` (2-D), ``dp,cp,tp`` (3-D), as the project names
them and as the reference's deleted approx benchmark named them.

Output: one JSON line on stdout (everything else goes to stderr): ``wall_s`` (process
start to the end of the solve, measured in-process), ``phases`` (seconds: ``import``,
``model``, ``init`` (deepcopy, dtype cast, move to fake), ``trace`` (the joint graph
export), ``optimizer_build`` (strategy enumeration, clustering, decision variables and
their costs), ``solve`` (the approximate solver: its factor build, TRW-S, polish,
write-back, extraction)), ``reference_profile`` (the optimizer's own ``profile`` dict:
timings, graph and strategy counts, variable counts), ``trws`` (iterations, last
delta), ``objective``, ``peak_rss_self_mib`` / ``peak_rss_children_mib``
(``getrusage``; the children are the cost-building fork workers).
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402
from unittest.mock import patch  # noqa: E402

#: LLaMA-3.2 1B (conf/model/llama1b.yaml of the project).
LLAMA1B = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8,
           "ffn_dim_multiplier": 1.5, "multiple_of": 256, "rope_theta": 500000.0,
           "norm_eps": 1e-5, "vocab_size": 128256, "seq_len": 2048, "batch_size": 16}

MESH_NAMES = {1: ("dp",), 2: ("dp", "tp"), 3: ("dp", "cp", "tp")}


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2,4,8"`` or ``"2x4x8"`` -> ``(2, 4, 8)``."""
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape) or len(shape) not in MESH_NAMES:
        raise argparse.ArgumentTypeError(
            f"--mesh {text!r}: allowed 1 to 3 positive integers joined by ',' or 'x'")
    return shape


def _cuda_patches() -> list[Any]:
    """CUDA device queries answered as for an H100 node (the reference's tests/conftest.py):
    the planner only reads device properties, it never runs a kernel."""
    props = type("Props", (), {"major": 9, "minor": 0, "name": "H100",
                               "total_memory": 80 * 1024**3,
                               "multi_processor_count": 132})()
    return [patch("torch.cuda.device_count", lambda: 8),
            # the compute model asks the current accelerator module for its name
            patch("torch.cpu.get_device_name", lambda *a, **k: "H100", create=True),
            patch("torch.cuda.get_device_name", lambda *a, **k: "H100"),
            patch("torch.cuda.get_device_capability", lambda *a, **k: (9, 0)),
            patch("torch.cuda.get_device_properties", lambda *a, **k: props)]


class _Records(logging.Handler):
    """Keeps the reference's INFO phase lines (short ones only: not the placement dump)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if len(text) < 2000:
            self.lines.append(f"{record.name}: {text}")


def _mib(kib: int) -> float:
    return kib / 1024  # ru_maxrss is KiB on Linux


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def run(mesh_shape: tuple[int, ...], n_layers: int, outputs: str, attention: str
        ) -> dict[str, Any]:
    phases: dict[str, float] = {}
    import autoparallel._testing.models.llama3 as llama3
    import autoparallel.approximate_sharding as approx_mod
    import torch
    from autoparallel._testing.models.llama3 import Transformer, TransformerModelArgs
    from autoparallel.api import AutoParallel
    from autoparallel.optimize_sharding import _PARALLEL_BUILD_WORKERS
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.placement_types import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    phases["import"] = time.perf_counter() - _T0

    records = _Records()
    logging.getLogger("autoparallel").addHandler(records)
    logging.getLogger("autoparallel").setLevel(logging.INFO)

    # Keep the solver instance the public path makes (for its iteration counts); the
    # wrapper only records ``self`` and calls the original method.
    solvers: list[Any] = []
    original = approx_mod.ApproximateShardingSolver.get_solution

    def get_solution(self: Any, verbose: bool = False) -> Any:
        solvers.append(self)
        return original(self, verbose=verbose)

    approx_mod.ApproximateShardingSolver.get_solution = get_solution  # type: ignore[method-assign]

    if attention == "flash":
        # What a GPU run traces (SDPA's flash backend): the fused aten op, which has
        # DTensor sharding rules. On a CPU build F.scaled_dot_product_attention would
        # dispatch to ..._flash_attention_for_cpu, which the reference can only
        # replicate. The project's built-in model calls the same op.
        def flash_forward(self: Any, q: Any, k: Any, v: Any) -> Any:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]

        llama3.ScaledDotProductAttention.forward = flash_forward  # type: ignore[method-assign]

    world = math.prod(mesh_shape)
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = torch.distributed.device_mesh.init_device_mesh(
        "cpu", mesh_shape, mesh_dim_names=MESH_NAMES[len(mesh_shape)])

    s = dict(LLAMA1B, n_layers=n_layers)
    args = TransformerModelArgs(
        dim=s["dim"], n_layers=s["n_layers"], n_heads=s["n_heads"],
        n_kv_heads=s["n_kv_heads"], vocab_size=s["vocab_size"],
        multiple_of=s["multiple_of"], ffn_dim_multiplier=s["ffn_dim_multiplier"],
        norm_eps=s["norm_eps"], rope_theta=s["rope_theta"], max_seq_len=s["seq_len"])
    t = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(args)
    phases["model"] = time.perf_counter() - t
    hidden = model.layers["0"].feed_forward.w1.weight.shape[0]

    def input_fn() -> Any:
        return torch.randint(0, s["vocab_size"], (s["batch_size"], s["seq_len"]),
                             device="cpu")

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    t = time.perf_counter()
    autop = AutoParallel(model, input_fn, mesh, mp, repeated_subgraphs=True, solver="approx")
    phases["init"] = time.perf_counter() - t
    t = time.perf_counter()
    with autop:
        enter = time.perf_counter() - t
        opt = autop.sharding_optimizer
        build = float(opt.profile["timings"].get("init_total_s", 0.0))
        phases["trace"] = enter - build
        phases["optimizer_build"] = build
        autop.add_parameter_memory_constraint(low=None, high=None)  # (0, 1 / world)
        x_sharding = (Shard(0),) + (Replicate(),) * (mesh.ndim - 1)
        autop.add_input_constraints([x_sharding])
        if outputs == "input":
            autop.add_output_constraints([x_sharding])
        elif outputs == "vocab":
            autop.add_output_constraints([(Shard(0),) + (Replicate(),) * (mesh.ndim - 2)
                                          + (Shard(2),)])
        t = time.perf_counter()
        autop.optimize_placement(verbose=False)
        phases["solve"] = time.perf_counter() - t
        wall = time.perf_counter() - _T0
        solver = solvers[-1] if solvers else None
        approx = opt.profile.get("approximate", {})
        result = {
            "planner": "autoparallel", "solver": "approx",
            "mesh": "x".join(str(d) for d in mesh_shape),
            "mesh_names": list(MESH_NAMES[len(mesh_shape)]), "world_size": world,
            "n_layers": n_layers, "ffn_hidden": hidden, "outputs": outputs, "attention": attention,
            "cost_workers": _PARALLEL_BUILD_WORKERS,
            "wall_s": wall, "phases": phases,
            "objective": approx.get("objective"), "status": approx.get("status"),
            "graph_nodes": opt.profile.get("model", {}).get("graph_nodes"),
            "optimizer_nodes": len(opt.nodes),
            "decision_vars": len(opt.decision_vars),
            "unique_variables": opt.profile.get("ilp", {}).get("unique_variables"),
            "logical_decision_variables":
                opt.profile.get("ilp", {}).get("logical_decision_variables"),
            "groups": approx.get("groups"),
            "cost_bearing_nodes": len(solver.cost_bearing) if solver is not None else None,
            "trws": None if solver is None else {
                "iterations": getattr(solver, "_bp_last_iter", None),
                "last_delta": getattr(solver, "_bp_last_delta", None)},
            "reference_profile": opt.profile,
            "log": records.lines,
        }
    result["peak_rss_self_mib"] = _mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    result["peak_rss_children_mib"] = _mib(
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    result["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "pulp": _version("pulp"), "numpy": _version("numpy")}
    result["load_1m_end"] = os.getloadavg()[0]
    return _jsonable(result)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", type=parse_mesh, default=(2, 4, 8),
                   help="device mesh, e.g. 2,4,8 or 8x8 (default 2,4,8)")
    p.add_argument("--n-layers", type=int, default=LLAMA1B["n_layers"],
                   help="transformer blocks (default 16, LLaMA-3.2 1B)")
    p.add_argument("--outputs", choices=("none", "input", "vocab"), default="none",
                   help="output placement constraint: none (the project's default), "
                        "input (as the input), vocab (S(0) ... S(2), the reference "
                        "example's vocab-parallel output)")
    p.add_argument("--attention", choices=("flash", "cpu"), default="flash",
                   help="flash: the attention calls aten._scaled_dot_product_flash_attention "
                        "as on a GPU (default); cpu: the model's own "
                        "F.scaled_dot_product_attention, which on this CPU build traces the "
                        "CPU kernel (replicate-only in the reference)")
    a = p.parse_args(argv)
    if a.n_layers < 1:
        p.error(f"--n-layers {a.n_layers}: allowed integers >= 1")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    patches = _cuda_patches()
    for q in patches:
        q.start()
    try:
        result = run(a.mesh, a.n_layers, a.outputs, a.attention)
    finally:
        for q in patches:
            q.stop()
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
