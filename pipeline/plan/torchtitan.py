"""A plan as torchtitan's job configuration (docs/pipelining.md, "Export to torchtitan"),
torch-free.

    python -m pipeline.plan.torchtitan <solve directory>    # plan.json + run.json there

torchtitan (``torchtitan/config/job_config.py``, ``Parallelism``, ``ActivationCheckpoint``,
``Compile``, ``Training``) describes a run by degrees over its mesh ``[pp,
dp_replicate, dp_shard, cp, tp]``, a pipeline schedule and microbatch size, the modules
of each pipeline stage (``module_fqns_per_model_part``), an activation-checkpointing mode
and whether to compile; it applies its own FSDP2 wrapping and tensor-parallel plan. A
plan is expressible there when every mesh dim of the stage plan plays one of those roles,
read from the plan file (the model inputs' placement and the parameters of the first
repeated layer on that dim):

=================  =======================  ==========================================
inputs on the dim  layer parameters         role
=================  =======================  ==========================================
``S(0)`` (batch)   all ``R``                ``data_parallel_replicate_degree``
``S(0)``           all sharded              ``data_parallel_shard_degree`` (FSDP2)
``S(1)`` (seq)     any                      ``context_parallel_degree``
``R``              Megatron pattern         ``tensor_parallel_degree``: column-parallel
                                            ``wq wk wv w1 w3`` ``S(0)``, row-parallel
                                            ``wo w2`` ``S(1)`` (``core/recipes.py``)
=================  =======================  ==========================================

Anything else (a dim that shards parameters but not the batch without the Megatron
pattern, parameters mixed on a data-parallel dim, dims out of torchtitan's order, a
checkpointing mode it lacks) is listed in ``not_expressible``, one line each, and the
degree is left out. What is always lost: the plan's own per-operator placements beyond
the dims' roles (torchtitan applies its fixed plans), which ``notes`` says.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from pipeline.core.placement_text import tokenize

__all__ = ["SCHEDULE_NAMES", "export", "to_toml"]

#: This project's schedules as torchtitan names them (``get_schedule_class``).
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
_COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
           "feed_forward.w3")
_ROW = ("attention.wo", "feed_forward.w2")
_ORDER = ("dp_replicate", "dp_shard", "cp", "tp")
_KEY = {"dp_replicate": "data_parallel_replicate_degree",
        "dp_shard": "data_parallel_shard_degree", "cp": "context_parallel_degree",
        "tp": "tensor_parallel_degree"}


def _role(dim: int, name: str, inputs: str, layer: dict[str, str]) -> tuple[str | None, str]:
    """(role or None, why) of mesh dim ``dim`` (module docstring)."""
    n = len(tokenize(inputs))
    tok = tokenize(inputs, n)[dim]
    params = {fqn: tokenize(p, n)[dim] for fqn, p in layer.items()}
    sharded = [t.is_shard() for t in params.values()]
    if tok.is_shard() and tok.dim == 0:
        if not any(sharded):
            return "dp_replicate", ""
        if all(sharded):
            return "dp_shard", ""
        return None, (f"mesh dim {name}: splits the batch with the layer parameters partly "
                      "sharded, partly replicated (FSDP2 shards every parameter of a unit)")
    if tok.is_shard() and tok.dim == 1:
        return "cp", ""

    def shard_dim(part: str) -> set[int | None]:
        return {t.dim if t.is_shard() else None for f, t in params.items() if part in f}

    if (tok.is_replicate() and all(shard_dim(c) == {0} for c in _COLUMN)
            and all(shard_dim(r) == {1} for r in _ROW)):
        return "tp", ""
    return None, (f"mesh dim {name}: inputs {inputs} and the layer parameters' placements "
                  "are none of data, context or Megatron tensor parallelism")


def export(plan: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """``{"job": {section: {key: value}}, "not_expressible": [...], "notes": [...]}`` for a
    plan file (``plan.json``) and its run's resolved config (``run.json``'s ``config``)."""
    names = list(plan["mesh"]["names"])
    shape = [int(d) for d in plan["mesh"]["shape"]]
    inputs = plan["inputs"][0]["placement"]
    layer = {p["fqn"].split("layers.0.", 1)[1]: p["placement"] for p in plan["parameters"]
             if p["fqn"].startswith("layers.0.")}
    missing, notes, roles = [], [], []
    degrees = dict.fromkeys(_ORDER, 1)
    for d, (name, size) in enumerate(zip(names, shape, strict=True)):
        role, why = _role(d, name, inputs, layer)
        roles.append(role)
        if role is None:
            missing.append(why)
        else:
            degrees[role] *= size
    placed = [r for r in roles if r is not None]
    if placed != sorted(placed, key=_ORDER.index):
        missing.append(f"mesh_names={names}: torchtitan orders its mesh [pp, dp_replicate, "
                       f"dp_shard, cp, tp]; this plan's dims are {placed}")
    if "tp" in placed or "cp" in placed:
        notes.append("torchtitan applies its own tensor / context parallel plan; the plan's "
                     "per-operator placements beyond the dims' roles are not carried over")
    model, pl = config["model"], config.get("pipeline") or {}
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    pp = int(config["mesh"][0]) if list(config["mesh_names"])[:1] == ["pp"] else 1
    accum = int(model.get("microbatches", 1) or 1)
    local = int(model["batch_size"]) // dp
    par: dict[str, Any] = {_KEY[r]: degrees[r] for r in _ORDER}
    par["pipeline_parallel_degree"] = pp
    ac = str((config.get("memory") or {}).get("activation_checkpointing", "none"))
    raf = bool((config.get("fsdp") or {}).get("reshard_after_forward", True))
    par["fsdp_reshard_after_forward"] = "always" if raf else "never"
    if pp > 1:
        par["pipeline_parallel_schedule"] = SCHEDULE_NAMES[str(pl["schedule"])]
        m = int(pl["microbatches"])
        par["pipeline_parallel_microbatch_size"] = local // accum // m
        par["module_fqns_per_model_part"] = [s["modules"] for s in plan["pipeline"]["stages"]]
    job: dict[str, Any] = {
        "training": {"local_batch_size": local // accum, "global_batch_size":
                     int(model["batch_size"]), "seq_len": int(model["seq_len"])},
        "parallelism": par,
        "compile": {"enable": bool((config.get("costs") or {}).get("compile", False))}}
    if ac in ("none", "full", "selective"):
        job["activation_checkpoint"] = {"mode": ac} | (
            {"selective_ac_option": "op"} if ac == "selective" else {})
    else:
        missing.append(f"memory.activation_checkpointing={ac}: torchtitan's modes are none, "
                       "full and selective (op or every n-th layer)")
    if math.prod(shape) * pp != math.prod(int(d) for d in config["mesh"]):
        missing.append("the plan's mesh and its run's mesh differ")
    return {"job": job, "not_expressible": missing, "notes": notes}


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    return json.dumps(v)


def to_toml(job: dict[str, dict[str, Any]]) -> str:
    """The job's sections as TOML text (scalars, strings and lists of them)."""
    lines: list[str] = []
    for section, keys in job.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_value(v)}" for k, v in keys.items()]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.plan.torchtitan <solve directory>``: the TOML on stdout, then
    what is not expressible as comments; exit 2 with one line for a missing file."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m pipeline.plan.torchtitan <solve directory>", file=sys.stderr)
        return 2
    where = Path(args[0])
    try:
        plan = json.loads((where / "plan.json").read_text())
        config = json.loads((where / "run.json").read_text())["config"]
    except (OSError, ValueError, KeyError) as err:
        print(f"{where}: no plan.json and run.json with its config there ({err}); allowed a "
              "run's solve directory", file=sys.stderr)
        return 2
    out = export(plan, config)
    print(to_toml(out["job"]), end="")
    for line in out["not_expressible"]:
        print(f"# not expressible: {line}")
    for line in out["notes"]:
        print(f"# note: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
