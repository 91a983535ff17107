"""The export of a plan to torchtitan's job configuration (pipeline/plan/torchtitan.py),
on hand-written plans whose dims' roles are known."""

from __future__ import annotations

import json

from pipeline.plan.torchtitan import export, main, to_toml

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
          "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")


def _plan(names, shape, inputs, col, row, norm, stages=None):
    params = ([{"fqn": f"layers.0.{p}.weight", "placement": col} for p in COLUMN]
              + [{"fqn": f"layers.0.{p}.weight", "placement": row} for p in ROW]
              + [{"fqn": "layers.0.attention_norm.weight", "placement": norm},
                 {"fqn": "tok_embeddings.weight", "placement": norm}])
    plan = {"mesh": {"names": names, "shape": shape}, "inputs": [{"placement": inputs}],
            "parameters": params}
    if stages is not None:
        plan["pipeline"] = {"stages": [{"modules": m} for m in stages]}
    return plan


def _config(mesh, names, batch=64, ac="full", schedule="1f1b", m=1, raf=False):
    return {"mesh": mesh, "mesh_names": names,
            "model": {"batch_size": batch, "seq_len": 8192, "microbatches": 1},
            "pipeline": {"schedule": schedule, "microbatches": m},
            "memory": {"activation_checkpointing": ac},
            "fsdp": {"reshard_after_forward": raf}, "costs": {"compile": True}}


def test_fsdp_tp_with_an_interleaved_pipeline():
    """pp 2 x dp 4 x tp 2: FSDP on dp (everything S(0) there), Megatron on tp (column
    S(0), row S(1), inputs R); batch 64 over dp 4 = 16 per rank, 8 microbatches of 2."""
    stages = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"],
              ["layers.3", "norm", "output"]]
    plan = _plan(["dp", "tp"], [4, 2], "S(0)R", "S(0)S(0)", "S(0)S(1)", "S(0)R", stages)
    out = export(plan, _config([2, 4, 2], ["pp", "dp", "tp"], schedule="interleaved_1f1b",
                               m=8))
    assert out["not_expressible"] == []
    par = out["job"]["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"],
            par["context_parallel_degree"], par["tensor_parallel_degree"],
            par["pipeline_parallel_degree"]) == (1, 4, 1, 2, 2)
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert par["pipeline_parallel_microbatch_size"] == 2
    assert par["module_fqns_per_model_part"] == stages
    assert par["fsdp_reshard_after_forward"] == "never"
    assert out["job"]["training"] == {"local_batch_size": 16, "global_batch_size": 64,
                                      "seq_len": 8192}
    assert out["job"]["activation_checkpoint"] == {"mode": "full"}
    assert out["job"]["compile"] == {"enable": True}
    text = to_toml(out["job"])
    assert 'pipeline_parallel_schedule = "Interleaved1F1B"' in text
    assert "tensor_parallel_degree = 2" in text
    assert len(out["notes"]) == 1  # torchtitan's own TP plan


def test_hsdp():
    plan = _plan(["dpr", "dps"], [2, 4], "S(0)S(0)", "RS(0)", "RS(0)", "RS(0)")
    out = export(plan, _config([2, 4], ["dpr", "dps"], ac="selective"))
    par = out["job"]["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (2, 4)
    assert out["job"]["training"]["local_batch_size"] == 8
    assert out["job"]["activation_checkpoint"] == {"mode": "selective",
                                                   "selective_ac_option": "op"}
    assert out["not_expressible"] == [] and out["notes"] == []


def test_not_expressible():
    # parameters sharded on a dim that does not split the batch, not as Megatron
    plan = _plan(["dp", "tp"], [4, 8], "S(0)R", "S(0)S(0)", "S(0)S(0)", "S(0)S(0)")
    out = export(plan, _config([4, 8], ["dp", "tp"], ac="selective_all_matmuls"))
    assert out["not_expressible"] == [
        "mesh dim tp: inputs S(0)R and the layer parameters' placements are none of data, "
        "context or Megatron tensor parallelism",
        "memory.activation_checkpointing=selective_all_matmuls: torchtitan's modes are "
        "none, full and selective (op or every n-th layer)"]
    # tensor parallel outside, data parallel inside: not torchtitan's mesh order
    plan = _plan(["tp", "dp"], [2, 4], "RS(0)", "S(0)S(0)", "S(1)S(0)", "RS(0)")
    out = export(plan, _config([2, 4], ["tp", "dp"]))
    assert out["not_expressible"] == [
        "mesh_names=['tp', 'dp']: torchtitan orders its mesh [pp, dp_replicate, dp_shard, "
        "cp, tp]; this plan's dims are ['tp', 'dp_shard']"]


def test_cli(tmp_path, capsys):
    plan = _plan(["dp"], [8], "S(0)", "S(0)", "S(0)", "S(0)")
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "run.json").write_text(json.dumps({"config": _config([8], ["dp"])}))
    assert main([str(tmp_path)]) == 0
    assert "data_parallel_shard_degree = 8" in capsys.readouterr().out
    assert main([str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "allowed a run's solve directory" in err[0]
