"""``pipeline.*`` and ``model.microbatches`` (pipeline/config/pipelining.py): resolution,
and every bad input as ``python -m pipeline`` shows it: one line, exit 2, nothing
written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_resolved
from pipeline.config.pipelining import balanced_split, data_parallel_dims

ROOT = Path(__file__).resolve().parents[2]
PP70 = ["model=llama70b", "mesh=4x8x8", "mesh_names=[pp,dp,tp]", "model.batch_size=128"]

BAD = [
    ("pp-inner", ["model=llama70b", "mesh=8x4x8", "mesh_names=[dp,pp,tp]"],
     "mesh_names=[dp,pp,tp]: the pipeline dim pp must be the outermost; allowed pp first, "
     "e.g. [pp,dp,tp]"),
    ("stages-over-layers", ["model=toy", "mesh=4x2", "mesh_names=[pp,dp]"],
     "mesh=4x2 (pp=4): 4 x 1 virtual stages = 4 stages, more than the model.n_layers=2 "
     "layers; allowed at most 2 stages"),
    ("microbatches-divide", [*PP70, "pipeline.microbatches=3"],
     "pipeline.microbatches=3: must divide the local batch of 16 samples "
     "(model.batch_size=128 over the data-parallel dims (dp=8)); allowed a divisor of 16"),
    ("1f1b-fewer", [*PP70, "pipeline.microbatches=2"],
     "pipeline.microbatches=2: 1f1b needs at least as many microbatches as pipeline stages "
     "(pp=4); allowed an integer >= 4 dividing 16, or pipeline.schedule=gpipe"),
    ("1f1b-auto-fewer", [*PP70[:3], "model.batch_size=16"],
     "pipeline.microbatches=auto (2): 1f1b needs at least as many microbatches as pipeline "
     "stages (pp=4); allowed a local batch of at least 4 samples (it is 2: "
     "model.batch_size=16 over the data-parallel dims (dp=8)), or pipeline.schedule=gpipe"),
    ("interleaved-rounds", [*PP70[:3], "model.batch_size=72", "pipeline.microbatches=9",
                            "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"],
     "pipeline.microbatches=9: interleaved_1f1b needs a multiple of its 2 rounds "
     "(microbatches // pp); allowed e.g. a multiple of 4"),
    ("virtual-divide", [*PP70, "pipeline.schedule=interleaved_1f1b",
                        "pipeline.virtual_stages=3"],
     "pipeline.virtual_stages=3: must divide the 20 layers per pp rank (model.n_layers=80 / "
     "pp=4); allowed a divisor of 20"),
    ("virtual-1f1b", [*PP70, "pipeline.virtual_stages=2"],
     "pipeline.virtual_stages=2: pipeline.schedule=1f1b runs one stage per pp rank; allowed "
     "1 (or pipeline.schedule=interleaved_1f1b)"),
    ("split-not-increasing", [*PP70, "pipeline.split=[0,20,50,40,80]"],
     "pipeline.split=[0,20,50,40,80]: not increasing; allowed strictly increasing layer "
     "boundaries (every stage holds at least one layer)"),
    ("split-not-covering", [*PP70, "pipeline.split=[0,20,40,60,70]"],
     "pipeline.split=[0,20,40,60,70]: does not cover the layers; allowed boundaries from 0 "
     "to model.n_layers=80"),
    ("split-count", [*PP70, "pipeline.split=[0,40,80]"],
     "pipeline.split=[0,40,80]: 3 boundaries; allowed 5 ([0, ..., 80], one stage per pp "
     "rank x virtual stage)"),
    ("schedule-unknown", [*PP70, "pipeline.schedule=zb"],
     "pipeline.schedule=zb: allowed gpipe, 1f1b, interleaved_1f1b"),
    ("model-microbatches", ["model=toy", "mesh=2x4", "model.microbatches=3"],
     "model.microbatches=3: must divide the local batch of 8 samples (model.batch_size=16 "
     "over the data-parallel dims (dp=2)); allowed a divisor of 8"),
    ("no-pipeline", ["model=toy", "mesh=2x4", "pipeline.microbatches=4"],
     "pipeline.microbatches=4: no mesh dim named pp of size > 1, so no pipeline; allowed "
     "auto or 1 (model.microbatches for gradient accumulation)"),
]


def test_the_interleaved_rounds_case_by_hand():
    # local batch 96 / 8 = 12; 6 microbatches divide it; 6 // 4 = 1 round and 6 % 1 == 0,
    # so torch accepts 6; 9 of 72 / 8 = 9 gives 2 rounds and 9 % 2 == 1: refused above.
    m = load_resolved([*PP70[:3], "model.batch_size=96", "pipeline.microbatches=6",
                       "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"])
    assert m.pipeline.microbatches == 6


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_one_line_exit_2_nothing_written(case, tmp_path, monkeypatch, capsys):
    import pipeline.__main__ as entry_main

    _, overrides, message = case
    with pytest.raises(ConfigError) as err:
        load_resolved(overrides)
    assert str(err.value) == message
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        entry_main.main([*overrides, f"results_dir={tmp_path / 'results'}"])
    out, errs = capsys.readouterr()
    assert exit_.value.code == 2
    assert errs.splitlines() == [message] and out == ""
    assert list(tmp_path.rglob("*")) == []


def test_through_the_real_interpreter(tmp_path):
    """``python -m pipeline`` as a user runs it, two bad pipelines."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    for name in ("pp-inner", "schedule-unknown"):
        _, overrides, message = next(c for c in BAD if c[0] == name)
        proc = subprocess.run([sys.executable, "-m", "pipeline", *overrides], cwd=tmp_path,
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines() == [message]
    assert list(tmp_path.rglob("*")) == []


def test_resolution():
    cfg = load_resolved(PP70)
    # local batch 128 / dp 8 = 16; auto: one sample per microbatch
    assert cfg.pipeline.microbatches == 16
    assert list(cfg.pipeline.split) == [0, 20, 40, 60, 80]
    inter = load_resolved([*PP70, "pipeline.schedule=interleaved_1f1b",
                           "pipeline.virtual_stages=2", "pipeline.microbatches=8"])
    assert list(inter.pipeline.split) == list(range(0, 81, 10))
    assert inter.pipeline.microbatches == 8
    # explicit split, and resolving the resolved config again gives the same config
    cfg = load_resolved([*PP70, "pipeline.split=[0,21,41,61,80]"])
    assert list(cfg.pipeline.split) == [0, 21, 41, 61, 80]
    # the batch sharded over dp and tp by constraints.inputs: local batch 128 / 64 = 2
    two = load_resolved([*PP70, "constraints.inputs=RS(0)S(0)", "pipeline.schedule=gpipe"])
    assert two.pipeline.microbatches == 2
    # gradient accumulation with a pipeline: 16 = 2 x 8 microbatches of one sample
    acc = load_resolved([*PP70, "model.microbatches=2"])
    assert (acc.model.microbatches, acc.pipeline.microbatches) == (2, 8)
    # no pipeline: defaults
    plain = load_resolved(["model=toy", "mesh=2x4"])
    assert (plain.pipeline.microbatches, plain.pipeline.split) == (1, "auto")


def test_resolve_is_idempotent_with_a_pipeline():
    from pipeline.config import resolve

    cfg = load_resolved([*PP70, "pipeline.schedule=interleaved_1f1b",
                         "pipeline.virtual_stages=2"])
    assert resolve(cfg) == cfg


def test_helpers_by_hand():
    assert balanced_split(10, 4) == [0, 3, 6, 8, 10]
    assert balanced_split(126, 8) == [0, 16, 32, 48, 64, 80, 96, 111, 126]
    assert data_parallel_dims(None, ["pp", "dp", "tp"]) == [1]
    assert data_parallel_dims(None, ["dp", "tp"]) == [0]
    assert data_parallel_dims("S(0)S(0)R", ["pp", "dp", "tp"]) == [1]
    assert data_parallel_dims("RS(0)S(0)", ["pp", "dp", "tp"]) == [1, 2]
    assert data_parallel_dims("RRS(1)", ["pp", "dp", "tp"]) == []


def test_pipeline_keys_are_in_the_solve_key_of_a_pipeline_only():
    """``pipeline.*`` enters the solve directory of a pipelined run (its step depends on
    them), not the earlier stages'; without a pp dim the keys are in no directory."""
    from pipeline.config import stage_dirs

    base = stage_dirs(load_resolved(PP70))
    other = stage_dirs(load_resolved([*PP70, "pipeline.schedule=gpipe",
                                      "pipeline.microbatches=8"]))
    assert (other.trace, other.topology, other.costs) == (base.trace, base.topology, base.costs)
    assert other.solve != base.solve
    plain = ["model=llama70b", "mesh=8,4"]
    assert stage_dirs(load_resolved([*plain, "pipeline.schedule=gpipe"])) == stage_dirs(
        load_resolved(plain))
