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

What ``tp`` means is fixed per model family by *module roles*
(:data:`TP_ROLE_TABLES`, :func:`tp_roles`): which modules are column-parallel linears
(their output features sharded), row-parallel linears (their input features sharded),
norms (computed on the sequence shard), the token embedding (vocabulary-parallel) and
the head (column-parallel). A recipe with a ``tp`` dim applies only to a model whose
family has a table (:func:`check_recipe_model`); the topology stage turns the roles into
pins on every node (:mod:`pipeline.stages.topology.recipe_pins`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["RECIPES", "TP_ROLE_TABLES", "TpRoles", "check_recipe_model", "data_dims",
           "recipe_dim_roles", "tp_roles"]

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


@dataclass(frozen=True)
class TpRoles:
    """The tensor-parallel roles of one model family's modules: module paths relative to
    a repeated layer (``attention.wq``), or from the model root outside the layers
    (``output``), as ``fnmatch`` patterns.

    Megatron-LM tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", sec. 3: the
    first linear of a block split by columns, the second by rows) with sequence
    parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", sec. 4.2.2: norms on sequence shards, an all-gather before the
    column-parallel linears, a reduce-scatter after the row-parallel ones), as
    torchtitan applies it (``torchtitan/models/llama3/infra/parallelize.py``,
    ``apply_tp``: ``ColwiseParallel`` wq/wk/wv/w1/w3, ``RowwiseParallel(output_layouts=
    Shard(1))`` wo/w2, ``SequenceParallel`` norms, a ``RowwiseParallel`` embedding with
    a sequence-sharded output, a ``ColwiseParallel`` output head).
    """

    column: tuple[str, ...]
    row: tuple[str, ...]
    norm: tuple[str, ...]
    embedding: tuple[str, ...]
    head: tuple[str, ...]

    def as_dict(self) -> dict[str, list[str]]:
        """Plain data (for the topology stage's constraints)."""
        return {k: list(v) for k, v in asdict(self).items()}


_LLAMA = TpRoles(
    column=("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
            "feed_forward.w3"),
    row=("attention.wo", "feed_forward.w2"),
    norm=("attention_norm", "ffn_norm", "norm"),
    embedding=("tok_embeddings",), head=("output",))
# transformers' LlamaDecoderLayer and the architectures built the same way (Qwen2 adds
# q/k/v biases, column-parallel with their weights); module names from
# transformers/models/llama/modeling_llama.py
_HF_LLAMA = TpRoles(
    column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
            "mlp.up_proj"),
    row=("self_attn.o_proj", "mlp.down_proj"),
    norm=("input_layernorm", "post_attention_layernorm", "model.norm"),
    embedding=("model.embed_tokens",), head=("lm_head",))

#: Module roles per model family (``llama``) or Hugging Face model type (``hf:<type>``).
#: A model without an entry (other hf types, e.g. Mixtral's experts or GPT-2's fused
#: QKV, a custom model) has no tensor-parallel recipe.
TP_ROLE_TABLES: dict[str, TpRoles] = {
    "llama": _LLAMA, "hf:llama": _HF_LLAMA, "hf:qwen2": _HF_LLAMA, "hf:mistral": _HF_LLAMA}


def _family_key(model: Any) -> str:
    family = str(model.get("family", "llama") or "llama")
    return f"hf:{model.get('model_type')}" if family == "hf" else family


def tp_roles(model: Any) -> TpRoles | None:
    """The module roles of a model config's family (:data:`TP_ROLE_TABLES`), or None."""
    return TP_ROLE_TABLES.get(_family_key(model))


def data_dims(roles: tuple[str, ...]) -> list[int]:
    """The mesh dims that shard the batch (roles ``replicate`` and ``shard``)."""
    return [d for d, r in enumerate(roles) if r in ("replicate", "shard")]


def check_recipe_model(recipe: str, mesh: list[int], names: list[str], model: Any) -> None:
    """Whether ``recipe`` applies to the model: a ``tp`` recipe needs the family's module
    roles; the data dims must split ``model.batch_size`` evenly (each data-parallel rank
    its own equal share of the batch); with ``tp`` / ``cp`` the sequence is split over
    them (sequence parallelism, context parallelism), so ``model.seq_len`` must be a
    multiple of their product.

    Raises:
        ValueError: one line naming the key, the value and what is allowed.
    """
    roles = recipe_dim_roles(recipe, names)
    if "tp" in roles and tp_roles(model) is None:
        known = ", ".join(TP_ROLE_TABLES)
        raise ValueError(f"recipe={recipe}: model={model.get('name')} "
                         f"({_family_key(model)}) has no tensor-parallel module roles; "
                         f"allowed for {known}, or recipe ddp, fsdp, hsdp")
    ways = 1
    for d in data_dims(roles):
        ways *= int(mesh[d])
    batch = model.get("batch_size")
    if batch is not None and int(batch) % ways:
        shown = " x ".join(f"{names[d]}={mesh[d]}" for d in data_dims(roles))
        raise ValueError(f"model.batch_size={batch}: recipe={recipe} shards the batch over "
                         f"the data dims {shown}; allowed a multiple of {ways}")
    seq_ways = 1
    for d, r in enumerate(roles):
        if r in ("tp", "cp"):
            seq_ways *= int(mesh[d])
    seq = model.get("seq_len")
    if seq_ways > 1 and seq is not None and int(seq) % seq_ways:
        raise ValueError(f"model.seq_len={seq}: recipe={recipe} shards the sequence over "
                         f"tp/cp ({seq_ways} ways); allowed a multiple of {seq_ways}")
