"""Plans that run, for Hugging Face models: tiny ``hf/gpt2`` (tied embeddings) at mesh
2x2 and tiny ``hf/mixtral`` (top-2 MoE, experts as ``aten._grouped_mm``) at mesh 4,
each executed with DTensor on gloo processes by ``pipeline.verify.run.verify``.

One layer each (the trace dominates the time; a second layer adds no new op), width 12
(GPT-2) and 16 (Mixtral: ``aten._grouped_mm`` wants 16-byte rows in bf16), vocabulary
48, 8 sequences of 12 tokens, and the slow hardware of tests/integration/test_verify.py, so the
plans shard (FSDP all-gathers, tensor-parallel partial sums). GPT-2's dropout is set
to 0: a step that draws random masks cannot be compared (that refusal is tested too).

Independent checks: every parameter tensor of the model (named by the module; the tied
``lm_head.weight`` is ``transformer.wte.weight``) has a gradient within 1e-5 of the
single-process step; the reference loss equals the cross-entropy this test computes
from transformers' own forward of the same seeded model; every node of
``graph.parquet`` was checked; the collectives counted equal the counts this test reads
from ``redistributions.parquet``; gradients leave the step in the plan's placements.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from fixtures import dtensor_planned
from omegaconf import OmegaConf
from test_verify import _prepare  # trace .. solve of a config, in this process

pytest.importorskip("transformers")

SHAPE = ("model.seq_len=12", "model.batch_size=8", "hardware.kernel_floor_us=0.0",
         "hardware.hbm_bandwidth=1e9", "hardware.peak_flops_fp32=1e9",
         "hardware.peak_flops_bf16=1e9")
GPT2 = ("model=hf/gpt2", "model.config.n_layer=1", "model.config.n_embd=12",
        "model.config.n_head=2", "model.config.n_positions=16", "model.config.vocab_size=48")
NO_DROPOUT = ("model.config.resid_pdrop=0", "model.config.embd_pdrop=0",
              "model.config.attn_pdrop=0")
MIXTRAL = ("model=hf/mixtral", "model.config.num_hidden_layers=1",
           "model.config.hidden_size=16", "model.config.intermediate_size=32",
           "model.config.num_attention_heads=2", "model.config.num_key_value_heads=1",
           "model.config.num_local_experts=4", "model.config.vocab_size=48",
           "model.config.max_position_embeddings=16")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("verify_hf")


def _own_loss(model, inputs) -> float:
    """The step's loss computed here: transformers' forward (the step replaced only the
    instance's ``forward``; the class's is the model's own), then mean cross-entropy of
    the unshifted logits against the labels."""
    from pipeline.dtensor.cpu_kernels import cpu_kernels

    input_ids, labels = inputs
    with torch.no_grad(), cpu_kernels():  # the fused attention op's CPU kernel
        logits = type(model).forward(model, input_ids=input_ids, use_cache=False).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                   labels.flatten()))


def _check_record(cfg, dirs, record: dict) -> list[str]:
    """The checks shared by both models; returns the parameter names."""
    from pipeline.verify.run import RTOL, build_real_model, real_inputs

    assert record["ok"], record.get("error") or record["checks"]
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model = build_real_model(model_cfg, 0)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(record["grads"]) == sorted(names)
    for fqn, g in record["grads"].items():
        assert g["rel_diff"] <= RTOL, (fqn, g)
    assert record["loss"]["rel_diff"] <= RTOL
    own = _own_loss(model, real_inputs(model_cfg, 0))
    assert record["loss"]["reference"] == pytest.approx(own, rel=1e-6)
    assert record["loss"]["value"] == pytest.approx(own, rel=1e-5)
    graph = pq.read_table(Path(dirs.trace) / "graph.parquet")
    assert record["placements"]["nodes_checked"] == graph.num_rows - 1
    redist = pq.read_table(Path(dirs.solve) / "redistributions.parquet")
    planned = dtensor_planned(redist.to_pylist(), tuple(int(m) for m in cfg.mesh),
                              list(cfg.mesh_names))
    assert planned, "the plan shards nothing: the check would be vacuous"
    assert record["collectives"]["counted"] == dict(planned)
    assert record["collectives"]["inside_ops"] == {}
    assert record["collectives"]["same_on_every_rank"]
    plan = json.loads((Path(dirs.solve) / "plan.json").read_text())
    stored = {p["fqn"]: p["placement"] for p in plan["parameters"]}
    assert {k: g["placement"] for k, g in record["grads"].items()} == stored
    assert any(p != "R" * len(cfg.mesh) for p in stored.values())
    return names


def test_gpt2_tied_embeddings_plan_runs_as_planned(results: Path) -> None:
    from pipeline.verify.run import build_real_model, verify

    cfg, dirs = _prepare([*GPT2, *NO_DROPOUT, *SHAPE, "mesh=2x2", f"results_dir={results}"])
    record = verify(cfg, applied=False)  # the applied path: test_parallelize.py
    assert record["processes"] == 4
    names = _check_record(cfg, dirs, record)
    # Tied: lm_head.weight is transformer.wte.weight, one tensor, one gradient, under
    # its first name; 1 layer: wte, wpe, 12 per block, ln_f weight and bias.
    model = build_real_model(OmegaConf.to_container(cfg.model, resolve=True), 0)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    assert len(names) == 2 + 12 + 2
    assert len(list(model.named_parameters(remove_duplicate=False))) == len(names) + 1


def test_mixtral_moe_plan_runs_as_planned(results: Path) -> None:
    from pipeline.verify.run import verify

    cfg, dirs = _prepare([*MIXTRAL, *SHAPE, "mesh=4", f"results_dir={results}"])
    graph = pq.read_table(Path(dirs.trace) / "graph.parquet").to_pydict()
    targets = collections.Counter(graph["target"])
    # bf16 experts: up and down projection forward, input and weight gradient of each
    assert targets["aten._grouped_mm.default"] == 2 + 4
    assert targets["aten.histc.default"] == 1  # tokens per expert, int32 expert ids
    record = verify(cfg, applied=False)  # the applied path: test_parallelize.py
    assert record["processes"] == 4
    names = _check_record(cfg, dirs, record)
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
            "model.layers.0.mlp.gate.weight"} <= set(names)


def test_dropout_is_refused_in_one_line(results: Path, capsys: pytest.CaptureFixture) -> None:
    """GPT-2's default dropout (0.1) traces ``aten.native_dropout``: exit 2, one line
    naming the node and the probability, no verify.json."""
    from pipeline.verify.run import main

    overrides = [*GPT2, *SHAPE, "mesh=2x2", f"results_dir={results}"]
    _, dirs = _prepare(overrides)
    before = {str(p) for p in Path(results).rglob("*") if p.name != ".lock"}
    assert main(overrides) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("node native_dropout (aten.native_dropout.default, ")
    assert "dropout p=0.1" in lines[0] and "model.config.resid_pdrop=0" in lines[0]
    assert {str(p) for p in Path(results).rglob("*") if p.name != ".lock"} == before
    assert not (Path(dirs.solve) / "verify.json").exists()


def test_mixtral_float32_experts_fallback_op_runs_replicated(results: Path) -> None:
    """float32 experts trace transformers' ``grouped_mm_fallback`` custom op, which
    DTensor has no strategy for: the plan runs it replicate-only (a fallback node, on
    the local replicated tensors), and the step still matches."""
    from pipeline.verify.run import verify

    cfg, dirs = _prepare([*MIXTRAL, *SHAPE, "model.param_dtype=float32", "mesh=2",
                          f"results_dir={results}"])
    graph = pq.read_table(Path(dirs.trace) / "graph.parquet").to_pydict()
    custom = [t for t in graph["target"] if "grouped_mm_fallback" in t]
    assert len(custom) == 2 + 2  # forward up and down; their backward ops
    plan = json.loads((Path(dirs.solve) / "plan.json").read_text())
    fallback = [n for n in plan["nodes"] if "grouped_mm_fallback" in n["op"]]
    assert len(fallback) == 4 and all(n["fallback"] and set(n["output"]) <= set("R(|)")
                                      for n in fallback)
    record = verify(cfg, applied=False)  # the applied path: test_parallelize.py
    assert record["processes"] == 2
    _check_record(cfg, dirs, record)
