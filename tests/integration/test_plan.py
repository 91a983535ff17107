"""The plan file (pipeline/plan/format.py) and the exports of pipeline/apply/.

A tiny toy is solved once in this process (mesh 2x2, dp x tp); the plan it writes is
checked against the solve stage's own tables, then edited in every way ``load`` must
refuse. Legality cases are worked out by hand; the FSDP / tensor-parallel reading of
a plan is checked against the redistributions the run itself lists.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.config import load_resolved, stage_dirs
from pipeline.plan.format import (
    PLAN_VERSION,
    Plan,
    PlanFileError,
    TensorPlan,
    load,
    model_hash,
    model_hash_of_module,
    placement_problem,
    trace_hash,
)

TINY = ("model=toy", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2",
        "model.multiple_of=32", "model.vocab_size=64", "model.seq_len=16",
        "model.batch_size=8", "hardware.kernel_floor_us=0.0", "hardware.hbm_bandwidth=1e9",
        "hardware.peak_flops_fp32=1e9", "hardware.peak_flops_bf16=1e9")


def _solve(results: Path, *extra: str):
    from pipeline.stages.runner import run_stage

    cfg = load_resolved([*TINY, f"results_dir={results}", *extra])
    dirs = stage_dirs(cfg)
    for stage in ("trace", "topology", "costs", "solve"):
        run_stage(stage, cfg, dirs)
    return cfg, dirs


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    results = tmp_path_factory.mktemp("plan")
    cfg, dirs = _solve(results, "mesh=2x2")
    return results, cfg, dirs, Path(dirs.solve) / "plan.json"


def _model(cfg):
    from pipeline.verify.run import build_real_model

    return build_real_model(dict(cfg.model), 0)


# --------------------------------------------------------------------------- legality


@pytest.mark.parametrize(("text", "shape", "partial_ok", "expect"), [
    ("S(0)R", [8, 4], False, None),
    ("S(-1)S(0)", [8, 4], False, None),           # 4 >= 2 and 8 >= 2
    ("S(0)S(0)", [4, 3], False, None),            # dim 0 split 2 * 2 = 4 ways: 4 >= 4
    ("S(1)S(1)", [8, 3], False, "tensor dim 1 of size 3 cannot be split into 4 shards"),
    ("S(2)R", [8, 4], False, "Shard(2) on mesh dim 0 of a 2-d tensor [8, 4]"),
    ("PR", [8, 4], False, "mesh dim 0 is Partial"),
    ("RP", [8, 4], True, None),
    ("RMP(0)", [8, 4], False, "mesh dim 1 is Partial"),
    ("S(0)", [8, 4], False, "1 token(s) for a 2-d mesh"),
    ("X(0)R", [8, 4], False, "cannot parse"),
])
def test_placement_problem_by_hand(text, shape, partial_ok, expect) -> None:
    why = placement_problem(text, shape, (2, 2), partial_ok=partial_ok)
    if expect is None:
        assert why is None
    else:
        assert why is not None and expect in why, why


def test_model_hash_ignores_order_and_counts_tied_parameters_once() -> None:
    a = [("param", "w", [2, 3], "float32"), ("buffer", "b", [3], "float32")]
    assert model_hash(a) == model_hash(list(reversed(a)))
    assert model_hash(a) != model_hash([("param", "w", [3, 2], "float32"), a[1]])

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.emb.weight

    assert model_hash_of_module(Tied()) == model_hash([("param", "emb.weight", [8, 4],
                                                        "float32")])


# --------------------------------------------------------------------------- the file


def test_solve_writes_the_plan_of_its_solution(run) -> None:
    _, cfg, dirs, path = run
    doc = json.loads(path.read_text())
    assert doc["format"] == "sharding-plan" and doc["version"] == PLAN_VERSION == 1
    assert doc["mesh"] == {"shape": [2, 2], "names": ["dp", "tp"]}
    record = json.loads((Path(dirs.solve) / "run.json").read_text())
    assert doc["run_id"] == record["run_id"]
    assert doc["placement_hash"] == record["placement_hash"]
    assert Path(dirs.solve).name.endswith(doc["config_hash"])
    sol = pd.read_parquet(Path(dirs.solve) / "solution.parquet").set_index("name")
    # every parameter of the model, with the placement of its placeholder row
    model = _model(cfg)
    assert [p["fqn"] for p in doc["parameters"]] == [n for n, _ in model.named_parameters()]
    for p in doc["parameters"]:
        assert p["placement"] == sol.loc[p["node"], "output_placement"]
        assert p["shape"] == list(model.get_parameter(p["fqn"]).shape)
    assert [b["fqn"] for b in doc["buffers"]] == ["freqs_cos", "freqs_sin"]
    assert [(i["index"], i["placement"]) for i in doc["inputs"]] == [(0, "S(0)R"), (1, "S(0)R")]
    # outputs: the loss (Replicate), then one gradient per parameter in its placement
    assert doc["outputs"][0]["kind"] == "loss" and doc["outputs"][0]["placement"] == "RR"
    grads = {o["grad_of"]: o["placement"] for o in doc["outputs"] if o["kind"] == "grad"}
    assert grads == {p["fqn"]: p["placement"] for p in doc["parameters"]}
    # every graph node with its chosen strategy
    graph = pq.read_table(Path(dirs.trace) / "graph.parquet")
    assert [n["name"] for n in doc["nodes"]] == graph.column("name").to_pylist()[:-1]
    for n in doc["nodes"]:
        assert n["output"] == sol.loc[n["name"], "output_placement"]
        assert n["inputs"] == list(sol.loc[n["name"], "input_placements"])
    assert {k: v["count"] for k, v in doc["collectives"].items()} == {
        k: v["count"] for k, v in record["collectives"].items()}


def test_load_accepts_the_plan_for_its_model_mesh_and_trace(run) -> None:
    _, cfg, dirs, path = run
    graph = pq.read_table(Path(dirs.trace) / "graph.parquet")
    plan = load(path, model=_model(cfg), mesh=(2, 2), graph=graph, world_size=4)
    assert plan.mesh_shape == (2, 2) and plan.mesh_names == ("dp", "tp")
    assert plan.trace_hash == trace_hash(graph)
    assert plan.world_size == 4
    assert len(plan.nodes) == graph.num_rows - 1


def _edited(tmp_path: Path, path: Path, edit) -> Path:
    doc = json.loads(path.read_text())
    edit(doc)
    out = tmp_path / "plan.json"
    out.write_text(json.dumps(doc))
    return out


def _param_node(doc: dict, k: int) -> dict:
    return next(n for n in doc["nodes"] if n["name"] == doc["parameters"][k]["node"])


@pytest.mark.parametrize(("edit", "expect"), [
    (lambda d: d.update(version=2), "version=2: allowed 1"),
    (lambda d: d.pop("nodes"), "missing key 'nodes'"),
    (lambda d: d.update(format="other"), "format=other: allowed 'sharding-plan'"),
    (lambda d: d["mesh"].update(names=["dp", "dp"]), "mesh.names=[\"dp\", \"dp\"]"),
    (lambda d: (d["parameters"][0].update(placement="PR"),
                _param_node(d, 0).update(output="PR")),
     "parameters[tok_embeddings.weight].placement=PR: mesh dim 0 is Partial"),
    (lambda d: (d["parameters"][2].update(placement="S(0)"),
                _param_node(d, 2).update(output="S(0)")),
     "1 token(s) for a 2-d mesh"),
    (lambda d: d["parameters"][2].update(placement="RR"),
     "differs from nodes[primals_3].output"),
    # a legal placement, but the file no longer matches its placement hash
    (lambda d: (d["parameters"][2].update(placement="RR"), _param_node(d, 2).update(
        output="RR")), "the file was edited or damaged"),
])
def test_load_refuses_a_bad_file(run, tmp_path: Path, edit, expect) -> None:
    _, _, _, path = run
    bad = _edited(tmp_path, path, edit)
    with pytest.raises(PlanFileError) as err:
        load(bad)
    msg = str(err.value)
    assert expect in msg and "\n" not in msg and msg.startswith(f"plan={bad}: ")


def test_load_refuses_a_truncated_or_missing_file(run, tmp_path: Path) -> None:
    _, _, _, path = run
    cut = tmp_path / "cut.json"
    cut.write_text(path.read_text()[:1000])
    with pytest.raises(PlanFileError, match="not a complete JSON document"):
        load(cut)
    with pytest.raises(PlanFileError, match="no such file"):
        load(tmp_path / "absent.json")


def test_load_refuses_another_model_mesh_trace_or_process_count(run) -> None:
    _, cfg, dirs, path = run
    from pipeline.verify.run import build_real_model

    other = build_real_model({**dict(cfg.model), "dim": 64}, 0)
    with pytest.raises(PlanFileError, match="belongs to another model"):
        load(path, model=other)
    with pytest.raises(PlanFileError, match=r"mesh=2x2 \(dp,tp\) does not match the mesh "
                                            r"being applied \(4\)"):
        load(path, mesh=(4,))
    with pytest.raises(PlanFileError, match="has 4 devices but 8 processes"):
        load(path, world_size=8)
    graph = pq.read_table(Path(dirs.trace) / "graph.parquet")
    names = graph.column("name").to_pylist()
    names[30] = names[30] + "_x"
    changed = graph.set_column(graph.schema.get_field_index("name"), "name", [names])
    with pytest.raises(PlanFileError, match="made from another trace"):
        load(path, graph=changed)


def _rehash(doc: dict) -> None:
    """Recompute ``placement_hash`` as docs/plan.md defines it (an edit a hash check
    cannot catch): SHA-256 over ``name<TAB>output<TAB>inputs`` of every node, then of
    every output sink in index order (its placement as output and input)."""
    import hashlib

    h = hashlib.sha256()
    rows = [(n["name"], n["output"], n["inputs"]) for n in doc["nodes"]] + [
        (o["node"], o["placement"], [o["placement"]])
        for o in sorted(doc["outputs"], key=lambda o: o["index"])]
    for name, out, ins in rows:
        h.update(f"{name}\t{out}\t{','.join(ins)}\n".encode())
    doc["placement_hash"] = h.hexdigest()


def _first_mm(doc: dict) -> dict:
    return next(n for n in doc["nodes"] if n["op"] == "aten.mm.default")


@pytest.mark.parametrize("form", ["arrow", "pandas", "path"])
def test_load_takes_the_graph_as_arrow_pandas_or_path(run, form) -> None:
    _, _, dirs, path = run
    graph_path = Path(dirs.trace) / "graph.parquet"
    graph = {"arrow": lambda: pq.read_table(graph_path),
             "pandas": lambda: pd.read_parquet(graph_path),  # as docs/plan.md shows it
             "path": lambda: graph_path}[form]()
    assert load(path, graph=graph).trace_hash == trace_hash(pq.read_table(graph_path))


@pytest.mark.parametrize(("field", "text", "expect"), [
    # the first mm of the toy reads the [128, 32] activations: no tensor dim 7
    ("inputs", "S(7)R", "inputs[0]=S(7)R: Shard(7) on mesh dim 0 of a 2-d tensor [128, 32]; "
                        "allowed S(d) with 0 <= d < 2"),
    ("output", "RS(-3)", "output=RS(-3): Shard(-3) on mesh dim 1 of a 2-d tensor"),
    ("inputs", "RR,RR", "inputs has 1 placements; allowed 2"),
])
def test_load_with_the_graph_refuses_an_illegal_node_placement(run, tmp_path, field, text,
                                                                expect) -> None:
    _, _, dirs, path = run
    doc = json.loads(path.read_text())
    node = _first_mm(doc)
    if field == "inputs" and "," in text:
        node["inputs"] = [text.split(",")[0]]
    elif field == "inputs":
        node["inputs"][0] = text
    else:
        node["output"] = text
    _rehash(doc)
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(doc))
    load(bad)  # a legal text: without the graph its rank is not known
    graph = pd.read_parquet(Path(dirs.trace) / "graph.parquet")
    with pytest.raises(PlanFileError) as err:
        load(bad, graph=graph)
    msg = str(err.value)
    assert msg.startswith(f"plan={bad}: nodes[{node['name']}].") and expect in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize(("data", "expect"), [
    (b"\x89PNG\r\n\x1a\n\x00\xff", "not a text file (byte 0x89 at offset 0 is not UTF-8)"),
    (b"[" * 100_000, "nested too deeply"),
    (b'[1, 2]', "allowed a JSON object, got list"),
])
def test_load_refuses_a_binary_or_odd_file_in_one_line(tmp_path, data, expect) -> None:
    bad = tmp_path / "plan.json"
    bad.write_bytes(data)
    with pytest.raises(PlanFileError) as err:
        load(bad)
    assert expect in str(err.value) and "\n" not in str(err.value)


def test_load_refuses_a_graph_that_is_no_table(run, tmp_path) -> None:
    _, _, _, path = run
    with pytest.raises(PlanFileError, match=r"graph=dict: allowed the graph IR as a pyarrow "
                                            r"Table, a pandas DataFrame or the path"):
        load(path, graph={"name": []})
    with pytest.raises(PlanFileError, match="cannot read the graph IR"):
        load(path, graph=tmp_path / "absent.parquet")


def test_verify_refuses_a_node_input_edited_to_s7_in_one_line(run, tmp_path) -> None:
    """The issue's case through the real CLI: a node input placement edited to S(7) with
    its hash recomputed is one line and exit 2 (was an IndexError on every rank)."""
    import os
    import subprocess
    import sys

    results, _, _, path = run
    doc = json.loads(path.read_text())
    node = _first_mm(doc)
    node["inputs"][0] = "S(7)R"
    _rehash(doc)
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(doc))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.verify", *TINY, "mesh=2x2", f"results_dir={results}",
         "--plan", str(bad)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "IndexError" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"plan={bad}: nodes[{node['name']}].inputs[0]=S(7)R: Shard(7) on mesh dim 0 of a "
        "2-d tensor [128, 32]; allowed S(d) with 0 <= d < 2")
    assert not (tmp_path / "verify.json").exists()


# --------------------------------------------------------------------------- exports


def test_state_dict_layout_covers_the_state_dict_and_tied_names(run) -> None:
    from pipeline.apply import state_dict_layout

    _, cfg, _, path = run
    plan = load(path)
    model = _model(cfg)
    layout = state_dict_layout(plan, model)
    # non-persistent RoPE buffers are not state
    assert sorted(layout) == sorted(model.state_dict())
    for p in plan.parameters:
        assert layout[p.name] == plan.placements(p.placement)

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = torch.nn.Embedding(8, 4)
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.wte.weight

    tied = Plan(path=Path("t.json"), version=1, run_id="r", config_hash="c", model_name="t",
                model_hash="h", model_config=None, trace_hash="t", placement_hash="p",
                mesh_shape=(2,),
                mesh_names=("dp",), parameters=(TensorPlan("wte.weight", "primals_1", (8, 4),
                                                           "float32", "S(0)"),),
                buffers=(), inputs=(), outputs=(), model_output=None, nodes=(),
                collectives={})
    from torch.distributed.tensor import Shard

    assert state_dict_layout(tied, Tied()) == {"wte.weight": (Shard(0),),
                                               "lm_head.weight": (Shard(0),)}


def test_distribute_state_dict_gives_the_planned_local_shapes(run) -> None:
    """Meta tensors become empty DTensors of the planned local shapes (fake process
    group, rank 0): worked out from each parameter's shape and placement."""
    from pipeline.apply import distribute_state_dict
    from pipeline.stages.topology import device_mesh

    _, cfg, _, path = run
    plan = load(path)
    mesh = device_mesh((2, 2), ("dp", "tp"))
    with torch.device("meta"):
        from pipeline.models.llama_decoder import build_model

        sd = build_model(dict(cfg.model)).state_dict()
    out = distribute_state_dict(sd, mesh, plan)
    for p in plan.parameters:
        want = list(p.shape)
        for size, token in zip((2, 2), plan.placements(p.placement)):
            if token.is_shard():
                want[token.dim] //= size
        assert list(out[p.name].to_local().shape) == want, p.name
        assert list(out[p.name].shape) == list(p.shape)


def test_torch_styles_agree_with_the_runs_redistributions(run) -> None:
    """A module read as FSDP over a mesh dim has its weight all-gathered on that dim
    before use; one read as tensor parallel over a dim is never gathered on it; a
    Colwise weight is stored S(0) and a Rowwise one S(1) there."""
    from pipeline.apply import torch_styles
    from pipeline.dtensor.placements import format_placements
    from pipeline.stages.topology import load_nodes

    _, _, dirs, path = run
    plan = load(path)
    graph = pq.read_table(Path(dirs.trace) / "graph.parquet")
    styles = torch_styles(plan, load_nodes(graph))
    assert set(styles.modules) | set(styles.unmatched) == {
        p.name.rsplit(".", 1)[0] for p in plan.parameters}
    redist = pq.read_table(Path(dirs.solve) / "redistributions.parquet").to_pylist()
    names = graph.column("name").to_pylist()
    consumers: dict[str, list[str]] = {}
    for i, args in enumerate(graph.column("args").to_pylist()):
        for ref in json.loads(args):
            if isinstance(ref, dict) and "node" in ref:
                consumers.setdefault(names[ref["node"]], []).append(names[i])

    def gathered_on(node: str, dim: str) -> bool:
        reach = {node} | set(consumers.get(node, []))  # the placeholder and its cast
        # a gather over a flattened group (all_gather(dp+tp)) gathers on each of its dims
        return any(r["producer_name"] in reach and any(
            c.startswith("all_gather(") and dim in c[len("all_gather("):-1].split("+")
            for c in r["collectives"]) for r in redist)

    checked = 0
    for module, style in styles.modules.items():
        for p in plan.parameters:
            if p.name.rsplit(".", 1)[0] != module:
                continue
            for dim in style.fsdp_dims:
                assert gathered_on(p.node, dim), (module, dim)
                checked += 1
            if style.tp_dim is not None:
                assert not gathered_on(p.node, style.tp_dim), module
                k = plan.mesh_names.index(style.tp_dim)
                token = format_placements((plan.placements(p.placement)[k],))
                want = {"ColwiseParallel": "S(0)", "RowwiseParallel": "S(1)"}
                if module == "tok_embeddings":  # an embedding table [vocab, dim]
                    want = {"ColwiseParallel": "S(1)", "RowwiseParallel": "S(0)"}
                assert token == want[style.tp_style], (module, token)
                checked += 1
    assert checked > 0
    for tp_dim, modules in styles.parallelize_plans().items():
        made = styles.parallel_styles(tp_dim)
        assert {k: type(v).__name__ for k, v in made.items()} == modules
