"""Repeated layers are tied by the topology stage: all 16 layers of llama1b form one class
(slow: llama1b's trace, about a minute), and a toy layer of another FFN width is not tied
to the others. The trace and topology of each model are made in a process of their own
(this file's own jobs), in a results directory of their own."""

from __future__ import annotations

import json
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures import SEED, Jobs

_REPEATED_SCRIPT = textwrap.dedent("""
    import json, sys
    from pipeline.config import load_resolved, stage_dirs
    from pipeline.stages.runner import run_stage
    results_dir, name = sys.argv[1:3]
    overrides = {
        "llama1b": ["model=llama1b", "mesh=8"],
        "toy3": ["model=toy", "model.n_layers=3", "model.ffn_hidden_overrides={1:512}",
                 "mesh=2x4"],
    }[name]
    cfg = load_resolved(overrides + [f"results_dir={results_dir}"])
    dirs = stage_dirs(cfg)
    run_stage("trace", cfg, dirs)
    run_stage("topology", cfg, dirs)
    out = {name: str(dirs.topology)}
    print("TOPOLOGY_DIRS " + json.dumps(out))
""")

#: This file's own subprocesses (fixtures.queue_own_jobs): key -> the tests that read it.
OWN_JOBS: dict[str, tuple[str, ...]] = {
    "repeated-llama1b": ("test_repeated_layers_llama1b_one_class",),
    "repeated-toy3": ("test_repeated_layers_other_width_not_tied",),
}


def own_job_argv(key: str, base: Path) -> tuple[list[str], str]:
    """(argv, PYTHONHASHSEED) of own job ``key``, writing under ``base``."""
    return [sys.executable, "-c", _REPEATED_SCRIPT, str(base / "repeated"),
            key.split("-")[1]], SEED


def _nodes_of(topology_dir: str) -> tuple[dict, dict]:
    summary = json.loads((Path(topology_dir) / "topology.json").read_text())
    nodes = pq.read_table(Path(topology_dir) / "nodes.parquet").to_pydict()
    return summary, nodes


def _groups_by_layer(nodes: dict) -> dict[str, set[int]]:
    out: dict[str, set[int]] = defaultdict(set)
    for layer, group in zip(nodes["layer"], nodes["group"]):
        if layer is not None:
            out[layer].add(group)
    return out


@pytest.mark.slow  # llama1b's trace: about a minute
def test_repeated_layers_llama1b_one_class(jobs: Jobs) -> None:
    dirs = jobs.result("repeated-llama1b").tagged("TOPOLOGY_DIRS")
    summary, nodes = _nodes_of(dirs["llama1b"])
    layers = [f"layers.{i}" for i in range(16)]
    classes = summary["repeated_blocks"]
    assert len(classes) == 1, classes
    cls = classes[0]
    assert cls["blocks"] == layers
    assert cls["nodes_per_block"] > 100
    assert cls["tied_pairs"] == cls["nodes_per_block"] * 15
    groups = _groups_by_layer(nodes)
    assert sorted(groups) == sorted(layers)
    for layer in layers[1:]:
        assert groups[layer] == groups["layers.0"], layer


def test_repeated_layers_other_width_not_tied(jobs: Jobs) -> None:
    dirs = jobs.result("repeated-toy3").tagged("TOPOLOGY_DIRS")
    summary, nodes = _nodes_of(dirs["toy3"])
    # the override took effect: layer 1's FFN is 512 wide, the others 768
    widths = {fqn: json.loads(m)[0]["shape"][0] for fqn, m in zip(nodes["fqn"],
                                                                   nodes["out_metas"])
              if fqn and fqn.endswith("feed_forward.w1.weight") and json.loads(m)[0]}
    assert widths == {"layers.0.feed_forward.w1.weight": 768,
                      "layers.1.feed_forward.w1.weight": 512,
                      "layers.2.feed_forward.w1.weight": 768}, widths
    classes = summary["repeated_blocks"]
    assert [c["blocks"] for c in classes] == [["layers.0", "layers.2"]], classes
    assert classes[0]["tied_pairs"] == classes[0]["nodes_per_block"]
    groups = _groups_by_layer(nodes)
    assert groups["layers.2"] == groups["layers.0"]
    assert not groups["layers.1"] & (groups["layers.0"] | groups["layers.2"])
