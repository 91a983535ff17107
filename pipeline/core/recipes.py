"""Recipes (config ``recipe``): the mesh dim roles of the standard hand-written plans.

Torchtitan-style plans (``torchtitan/models/llama3/infra/parallelize.py``: ``apply_fsdp``,
``apply_tp``); the topology stage expresses them as pins
(:mod:`pipeline.stages.topology.pins`, which says what each role pins), and the config
validation checks a recipe against the mesh names here, without the stage. Each mesh dim
gets a role: ``replicate`` (data parallel, parameters replicated), ``shard`` (data
parallel, parameters sharded: FSDP2 shards dim 0), ``tp`` (Megatron tensor parallel with
sequence parallelism) or ``cp`` (context parallel: the sequence is sharded; FSDP shards
the parameters over it too, as torchtitan's ``dp_shard_cp`` mesh).

==============  ===================================================  ====================
recipe          mesh dim roles                                       applies to
==============  ===================================================  ====================
``ddp``         every dim ``replicate``                              any mesh
``fsdp``        every dim ``shard``                                  any mesh
``hsdp``        the first dim ``replicate``, the others ``shard``    2+ dims
``fsdp_tp``     ``tp``: ``tp``; every other dim (dp, cp...) ``shard``  a ``tp`` dim + another
``fsdp_tp_cp``  as ``fsdp_tp``, and ``cp``: ``cp``                   ``cp``, ``tp`` + another
==============  ===================================================  ====================
"""

from __future__ import annotations

__all__ = ["RECIPES", "recipe_dim_roles"]

#: The recipes of config ``recipe`` (module docstring).
RECIPES: tuple[str, ...] = ("ddp", "fsdp", "hsdp", "fsdp_tp", "fsdp_tp_cp")


def recipe_dim_roles(recipe: str, mesh_names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The role of each mesh dim under ``recipe`` (module docstring).

    Raises:
        ValueError: one line naming the recipe and the mesh names, for an unknown recipe
            or a mesh it does not apply to.
    """
    names = list(mesh_names)
    shown = f"recipe={recipe}"
    mesh = f"mesh_names=[{','.join(names)}]"
    if recipe not in RECIPES:
        raise ValueError(f"{shown}: allowed {', '.join(RECIPES)} or null")
    if recipe == "ddp":
        return ("replicate",) * len(names)
    if recipe == "fsdp":
        return ("shard",) * len(names)
    if recipe == "hsdp":
        if len(names) < 2:
            raise ValueError(f"{shown}: needs a mesh of 2 or more dims (replicate on the "
                             f"first, shard on the others); got {mesh}")
        return ("replicate",) + ("shard",) * (len(names) - 1)
    need = ["tp"] if recipe == "fsdp_tp" else ["cp", "tp"]
    if any(n not in names for n in need) or len(names) <= len(need):
        raise ValueError(f"{shown}: needs mesh dims named {' and '.join(need)} and at least "
                         f"one data dim; got {mesh}")
    return tuple("tp" if n == "tp" else ("cp" if n == "cp" and recipe == "fsdp_tp_cp"
                                          else "shard") for n in names)
