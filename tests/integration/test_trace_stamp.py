"""The depth-independent trace (pipeline/stages/trace/stamp.py): a 4-block trace stamped to N
blocks is the full trace of N blocks, every column and row, and the same stage metadata;
models whose blocks are not provably identical are traced in full, with the reason."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from pipeline.config.compose import load_resolved
from pipeline.core.artifacts import GRAPH_FILE
from pipeline.stages.trace.stage import run_trace, trace_model

#: Stage metadata that differs between two runs of one trace (timings, memory) or says
#: how the graph was made.
_RUN_FACTS = ("seconds", "peak_rss_bytes", "trace_method")


def _traced(tmp_path, overrides: list[str], stamp: bool) -> tuple:
    cfg = load_resolved([*overrides, f"stamp_layers={'true' if stamp else 'false'}"])
    out = tmp_path / ("stamped" if stamp else "full")
    run_trace(cfg, out)
    table = pq.read_table(out / GRAPH_FILE)
    meta = json.loads(table.schema.metadata[b"pipeline"])
    return table, meta


def _assert_stamped_is_full(tmp_path, overrides: list[str], n_layers: int) -> None:
    from pipeline.plan.format import trace_hash

    stamped, smeta = _traced(tmp_path, overrides, True)
    full, fmeta = _traced(tmp_path, overrides, False)
    assert smeta["trace_method"] == {"stamped": True, "traced_layers": 4}
    assert fmeta["trace_method"] == {"stamped": False, "why": "stamp_layers=false"}
    assert stamped.schema.equals(full.schema, check_metadata=False)
    assert stamped.equals(full)
    assert trace_hash(stamped) == trace_hash(full)
    assert ({k: v for k, v in smeta.items() if k not in _RUN_FACTS}
            == {k: v for k, v in fmeta.items() if k not in _RUN_FACTS})
    assert smeta["model_info"]["layers"] == n_layers


def test_toy_llama_stamped_equals_full(tmp_path):
    _assert_stamped_is_full(tmp_path, ["model=toy", "model.n_layers=6"], 6)


def test_llama1b_shapes_stamped_equals_full(tmp_path):
    _assert_stamped_is_full(tmp_path, ["model=llama1b", "model.n_layers=6"], 6)


@pytest.mark.slow
def test_hf_gpt2_stamped_equals_full(tmp_path):
    pytest.importorskip("transformers")
    _assert_stamped_is_full(tmp_path, ["model=hf/gpt2", "model.config.n_layer=6"], 6)


@pytest.mark.slow
def test_hf_qwen2_stamped_equals_full(tmp_path):
    pytest.importorskip("transformers")
    _assert_stamped_is_full(tmp_path, ["model=hf/qwen2", "model.config.num_hidden_layers=6"],
                            6)


@pytest.mark.slow
def test_hf_mixtral_stamped_equals_full(tmp_path):
    """MoE blocks whose expert backward holds ops without a module path (unlabelled runs
    inside each block's backward, counted as the block's nodes)."""
    pytest.importorskip("transformers")
    _assert_stamped_is_full(tmp_path, ["model=hf/mixtral", "model.config.num_hidden_layers=6"],
                            6)


def _model(overrides: list[str]) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(load_resolved(overrides).model, resolve=True)


def test_different_ffn_width_traces_in_full():
    table, facts = trace_model(
        _model(["model=toy", "model.n_layers=5", "model.ffn_hidden_overrides={3: 512}"]), 8)
    assert facts["method"] == {
        "stamped": False,
        "why": "block layers.3 differs from layers.0 (modules, tensors or attributes)"}
    rows = table.to_pylist()
    w1 = {r["fqn"]: r["outputs"] for r in rows if r["fqn"] and r["fqn"].endswith("w1.weight")}
    assert json.loads(w1["layers.3.feed_forward.w1.weight"])[0]["shape"] == [512, 256]
    assert json.loads(w1["layers.4.feed_forward.w1.weight"])[0]["shape"] == [768, 256]
    assert facts["model_info"]["layers"] == 5


def test_four_layers_trace_in_full():
    _, facts = trace_model(_model(["model=toy", "model.n_layers=4"]), 8)
    assert facts["method"] == {
        "stamped": False, "why": "4 blocks in layers (stamping needs at least 5)"}


@pytest.fixture(scope="module")
def toy_short():
    """The full 4-block IR of the toy LLaMA (the template a stamp starts from)."""
    table, _ = trace_model(_model(["model=toy", "model.n_layers=4"]), 8)
    return table


def test_stamp_to_four_gives_the_trace_back(toy_short):
    from pipeline.stages.trace.stamp import stamp

    assert stamp(toy_short, "layers", 4).equals(toy_short)


def test_middle_blocks_that_differ_are_refused(toy_short):
    """A middle block whose op differs (a forward branching on the layer index) is no
    proof: stamping refuses it."""
    import pyarrow as pa

    from pipeline.stages.trace.stamp import StampError, stamp

    targets = toy_short.column("target").to_pylist()
    layers = toy_short.column("layer").to_pylist()
    j = next(i for i, (t, lab) in enumerate(zip(targets, layers))
             if lab == "layers.2" and t == "aten.mm.default")
    targets[j] = "aten.bmm.default"
    changed = toy_short.set_column(toy_short.column_names.index("target"), "target",
                                   pa.array(targets))
    with pytest.raises(StampError, match="middle blocks differ"):
        stamp(changed, "layers", 6)


def test_unlabelled_node_reading_a_middle_block_is_refused(toy_short):
    """A node outside the blocks that reads a middle block's tensor (an auxiliary loss
    summed over the layers) is not stamped."""
    import pyarrow as pa

    from pipeline.stages.trace.stamp import StampError, stamp

    layers = toy_short.column("layer").to_pylist()
    kinds = toy_short.column("kind").to_pylist()
    middle = next(i for i, lab in enumerate(layers) if lab == "layers.1")
    j = max(i for i, (lab, k) in enumerate(zip(layers, kinds))
            if lab is None and k == "call_function")
    args = toy_short.column("args").to_pylist()
    args[j] = json.dumps([{"node": middle}])
    changed = toy_short.set_column(toy_short.column_names.index("args"), "args",
                                   pa.array(args))
    with pytest.raises(StampError, match="refers to middle block 1"):
        stamp(changed, "layers", 6)


def test_fx_names_follow_the_counter_gaps(toy_short):
    """The stamped names are the names FX gives the 6-block graph: per base name a
    counter advancing by each template node's gap (dead-code elimination leaves gaps,
    e.g. getitem_6..9 missing in the toy trace), compared with a real 6-block trace."""
    from pipeline.stages.trace.stamp import stamp

    names = toy_short.column("name").to_pylist()
    getitems = [n for n in names if n.startswith("getitem")][:8]
    assert getitems[:6] == ["getitem", *[f"getitem_{i}" for i in range(1, 6)]]
    assert getitems[6] != "getitem_6"  # a gap the counter rule has to follow
    full, _ = trace_model(_model(["model=toy", "model.n_layers=6"]), 8, stamp_layers=False)
    assert (stamp(toy_short, "layers", 6).column("name").to_pylist()
            == full.column("name").to_pylist())


def test_name_gaps_of_a_hand_made_list():
    """``base`` / ``base_n``: each name's number is the previous number of its base plus
    its gap; worked by hand for a list with a gap and a base starting at 1."""
    from pipeline.stages.trace.stamp import name_gaps, names_from_gaps

    names = ["primals_1", "primals_2", "mm", "getitem", "mm_1", "getitem_3", "mm_2"]
    gaps = name_gaps(names)
    assert gaps == [("primals", 1), ("primals", 1), ("mm", 0), ("getitem", 0), ("mm", 1),
                    ("getitem", 3), ("mm", 1)]
    assert names_from_gaps(gaps) == names
    # the same pattern one more time: counters continue from where each base stopped
    assert names_from_gaps(gaps + gaps[4:6]) == [*names, "mm_3", "getitem_6"]


_INDEXED_FILE = '''
import torch
import torch.nn as nn


class Indexed(nn.Module):
    """Blocks reached by index up to a depth stored apart from the list."""

    def __init__(self, layers: int = 6):
        super().__init__()
        self.depth = layers
        self.embed = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))

    def forward(self, tokens):
        h = self.embed(tokens)
        for i in range(self.depth):
            h = self.blocks[i](h)
        return h
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user's directory with the README's custom model and a depth-indexed one."""
    import shutil
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    shutil.copy(root / "examples" / "custom_model.py", tmp_path / "custom_model.py")
    (tmp_path / "indexed_model.py").write_text(_INDEXED_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("custom_model", "indexed_model"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def test_custom_model_stamped_equals_full(user_dir, tmp_path):
    """The README's custom module (its head tied to the embedding, outside the blocks)."""
    _assert_stamped_is_full(tmp_path, [
        "model=custom", "model.builder._target_=custom_model.TinyLM", "model.builder.vocab=48",
        "model.builder.dim=12", "model.builder.hidden=24", "model.builder.layers=6",
        "model.inputs=[{name:tokens,shape:[8,12],dtype:int64,high:48}]"], 6)


def test_forward_indexing_the_full_depth_traces_in_full(user_dir):
    table, facts = trace_model(_model([
        "model=custom", "model.builder._target_=indexed_model.Indexed",
        "model.inputs=[{name:tokens,shape:[2,4],dtype:int64,high:32}]"]), 8)
    assert facts["method"]["stamped"] is False
    assert facts["method"]["why"].startswith("the forward cannot run with 4 blocks (")
    assert facts["model_info"]["layers"] == 6
    fqns = [f for f in table.column("fqn").to_pylist() if f]
    assert "blocks.5.weight" in fqns


def test_switch_reaches_the_trace_rule_and_not_the_key():
    """``stamp_layers=false`` is passed to the Snakemake trace rule but keys no directory
    (a stamped and a full trace are the same IR)."""
    from pipeline.config import stage_dirs, stage_overrides

    on = load_resolved(["model=toy"])
    off = load_resolved(["model=toy", "stamp_layers=false"])
    assert on.stamp_layers is True and off.stamp_layers is False
    assert stage_dirs(on) == stage_dirs(off)
    assert "stamp_layers=false" not in stage_overrides(on, "trace")
    assert stage_overrides(off, "trace") == [*stage_overrides(on, "trace"), "stamp_layers=false"]
    assert load_resolved(stage_overrides(off, "trace")).stamp_layers is False
