"""Module roles of tensor parallelism (pipeline/core/recipes.py) and how a module path
finds its role (pipeline/stages/topology/recipe_pins.py)."""

from __future__ import annotations

import pytest

from pipeline.core.recipes import TP_ROLE_TABLES, check_recipe_model, data_dims, tp_roles
from pipeline.stages.topology.recipe_pins import module_role

LLAMA = TP_ROLE_TABLES["llama"].as_dict()
HF = TP_ROLE_TABLES["hf:llama"].as_dict()


@pytest.mark.parametrize(("path", "layer", "table", "role"), [
    ("layers.3.attention.wq", "layers.3", LLAMA, "column"),
    ("layers.3.feed_forward.w2", "layers.3", LLAMA, "row"),
    ("layers.3.attention_norm", "layers.3", LLAMA, "norm"),
    ("layers.3.attention", "layers.3", LLAMA, None),  # the attention core: no role
    ("norm", None, LLAMA, "norm"),
    ("output", None, LLAMA, "head"),
    ("tok_embeddings", None, LLAMA, "embedding"),
    ("model.layers.0.self_attn.o_proj", "model.layers.0", HF, "row"),
    ("model.layers.0.mlp.up_proj", "model.layers.0", HF, "column"),
    ("model.norm", None, HF, "norm"),
    ("lm_head", None, HF, "head"),
    ("", None, LLAMA, None),
])
def test_module_role(path: str, layer: str | None, table: dict, role: str | None) -> None:
    assert module_role(path, layer, table) == role


def test_tables() -> None:
    assert tp_roles({"family": "llama"}) is TP_ROLE_TABLES["llama"]
    assert tp_roles({"family": "hf", "model_type": "qwen2"}) is TP_ROLE_TABLES["hf:llama"]
    assert tp_roles({"family": "hf", "model_type": "mixtral"}) is None
    assert tp_roles({"family": "custom"}) is None
    assert data_dims(("shard", "cp", "tp")) == [0] and data_dims(("replicate", "shard")) == [0, 1]


def test_check_recipe_model() -> None:
    """Batch over the data dims, sequence over tp x cp, roles for tp (one line each)."""
    toy = {"family": "llama", "name": "toy", "batch_size": 16, "seq_len": 2048}
    check_recipe_model("fsdp_tp", [2, 4], ["dp", "tp"], toy)
    check_recipe_model("fsdp", [4, 4], ["dp", "tp"], toy)
    with pytest.raises(ValueError, match=r"^model.batch_size=16: recipe=fsdp shards the batch "
                       r"over the data dims dp=4 x tp=8; allowed a multiple of 32$"):
        check_recipe_model("fsdp", [4, 8], ["dp", "tp"], toy)
    with pytest.raises(ValueError, match=r"^model.seq_len=2040: recipe=fsdp_tp_cp shards the "
                       r"sequence over tp/cp \(16 ways\); allowed a multiple of 16$"):
        check_recipe_model("fsdp_tp_cp", [2, 4, 4], ["dp", "cp", "tp"],
                           {**toy, "seq_len": 2040})
    with pytest.raises(ValueError, match=r"^recipe=fsdp_tp: model=m \(custom\) has no "):
        check_recipe_model("fsdp_tp", [2, 2], ["dp", "tp"], {"family": "custom", "name": "m"})
