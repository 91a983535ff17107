"""Config layer: composing every option, mesh parsing, resolution, bad input through
``load_config`` and through ``python -m pipeline``, result-path keys and stage reuse."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from bad_configs import BAD_CASES
from omegaconf import OmegaConf

from pipeline.config import (
    STAGES,
    Config,
    ConfigError,
    config_hash,
    group_options,
    load_config,
    load_resolved,
    normalise_overrides,
    override_value,
    overrides_from_snakemake,
    parse_mesh,
    resolve,
    stage_code_hash,
    stage_dirs,
    stage_overrides,
    sweep_overrides,
)
from pipeline.models.llama import ffn_hidden_dim
from pipeline.stages import runner as cli

ROOT = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------- composing


@pytest.mark.parametrize("group", ["model", "solver", "hardware", "experiment"])
def test_every_option_of_every_group_composes(group):
    options = group_options(group)
    if group != "experiment":
        assert options, f"conf/{group} has no options"
    for option in options:
        cfg = load_resolved([f"{group}={option}"])
        if group == "experiment":
            assert cfg.experiment == option, "an experiment must set experiment: <its name>"
        else:
            assert cfg[group].name == option, f"conf/{group}/{option}.yaml: name != file name"


def test_group_options_are_the_expected_files():
    assert group_options("model") == ["llama1b", "llama405b", "llama70b", "llama8b", "toy"]
    assert group_options("solver") == ["approx", "ilp", "lp"]
    assert "h100" in group_options("hardware")


# Published shapes (Meta's params.json / Dubey et al. 2024, Table 3): FFN hidden sizes
# 8192 (1B), 14336 (8B), 28672 (70B), 53248 (405B: 4096 * ceil(int(1.2 * 43690) / 4096));
# toy: 256 * ceil(int(8 * 256 / 3) / 256) = 768.
@pytest.mark.parametrize("name, dim, layers, heads, kv, hidden", [
    ("llama1b", 2048, 16, 32, 8, 8192),
    ("llama8b", 4096, 32, 32, 8, 14336),
    ("llama70b", 8192, 80, 64, 8, 28672),
    ("llama405b", 16384, 126, 128, 8, 53248),
    ("toy", 256, 2, 8, 4, 768),
])
def test_model_presets(name, dim, layers, heads, kv, hidden):
    m = load_resolved([f"model={name}"]).model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads) == (dim, layers, heads, kv)
    assert ffn_hidden_dim(m.dim, m.ffn_dim_multiplier, m.multiple_of) == hidden
    if name == "toy":
        assert (m.vocab_size, m.seq_len, m.batch_size) == (1024, 2048, 16)
    else:
        assert (m.vocab_size, m.seq_len, m.batch_size) == (128256, 2048, 16)
        assert m.rope_theta == 500000.0
    assert (m.param_dtype, m.reduce_dtype) == ("bfloat16", "float32")


def test_solver_presets():
    approx = load_resolved(["solver=approx"]).solver
    assert (approx.max_iters, approx.tol, approx.local_search_rounds) == (500, 1e-7, 50)
    assert approx.prune is True and approx.time_limit_s is None
    for name in ("ilp", "lp"):
        s = load_resolved([f"solver={name}"]).solver
        assert (s.backend, s.time_limit_s, s.mip_gap, s.threads) == ("highs", None, 0.0, 1)


def test_defaults_and_config_yaml_agree_with_the_schema():
    cfg = load_config([])
    schema = OmegaConf.structured(Config)
    for key in ("mesh", "mesh_names", "lazy_costs", "repeated_layers", "optimality_check",
                "results_dir", "experiment", "revision_label", "workers", "constraints"):
        assert cfg[key] == schema[key], key
    assert (cfg.model.name, cfg.hardware.name, cfg.solver.name) == ("llama1b", "h100", "approx")


# --------------------------------------------------------------------------- resolution


@pytest.mark.parametrize("value, expected", [
    ("2,4,8", [2, 4, 8]), ("2x4x8", [2, 4, 8]), ("8", [8]), (8, [8]), ([2, 4, 8], [2, 4, 8]),
    (["2", "4"], [2, 4]), (" 2, 4 ", [2, 4]), ("2X4", [2, 4]), ("1x1", [1, 1]),
])
def test_parse_mesh(value, expected):
    assert parse_mesh(value) == expected


@pytest.mark.parametrize("value", ["2,0,8", "abc", "", "-2", "2,,8", "2.5", 0, -1, True, 2.0,
                                   [], [2, 0], ["a"], None])
def test_parse_mesh_refuses(value):
    with pytest.raises(ConfigError, match=r"^mesh=.*: allowed positive integers"):
        parse_mesh(value)


@pytest.mark.parametrize("mesh, names", [
    ("8", ["dp"]), ("2x4", ["dp", "tp"]), ("2,4,8", ["dp", "cp", "tp"]),
])
def test_default_mesh_names(mesh, names):
    assert list(load_resolved([f"mesh={mesh}"]).mesh_names) == names


def test_explicit_mesh_names_and_rank_4():
    cfg = load_resolved(["mesh=2x2x2x2", "mesh_names=[pp,dp,cp,tp]"])
    assert list(cfg.mesh) == [2, 2, 2, 2] and list(cfg.mesh_names) == ["pp", "dp", "cp", "tp"]
    with pytest.raises(ConfigError, match=r"^mesh_names=null: a 4-d mesh has no default"):
        load_resolved(["mesh=2x2x2x2"])


@pytest.mark.parametrize("overrides, lazy", [
    (["solver=approx"], True), (["solver=ilp"], False), (["solver=lp"], False),
    (["solver=approx", "lazy_costs=false"], False), (["solver=ilp", "lazy_costs=false"], False),
    (["solver=approx", "lazy_costs=true"], True),
])
def test_lazy_costs_resolution(overrides, lazy):
    assert load_resolved(overrides).lazy_costs is lazy


def test_param_memory_high_defaults_to_one_over_mesh_size():
    assert load_resolved(["mesh=2,4,8"]).constraints.param_memory.high == 1 / 64
    assert load_resolved(["mesh=8"]).constraints.param_memory.high == 0.125
    cfg = load_resolved(["constraints.param_memory.high=0.5"])
    assert cfg.constraints.param_memory.high == 0.5
    assert load_resolved(["constraints.param_memory=null"]).constraints.param_memory is None


def test_resolve_is_idempotent_and_leaves_its_input_alone():
    cfg = load_config(["mesh=2x4"])
    once = resolve(cfg)
    assert cfg.mesh == "2x4" and cfg.lazy_costs is None
    assert OmegaConf.to_container(resolve(once)) == OmegaConf.to_container(once)


def test_constraints_accept_placements_and_pins():
    cfg = load_resolved(["constraints.inputs=S(0)RR", "constraints.outputs=RRR",
                         "constraints.nodes=[{match:'layers.0.*',placement:'S(0)RS(1)'}]"])
    assert cfg.constraints.inputs == "S(0)RR"
    assert cfg.constraints.nodes[0].placement == "S(0)RS(1)"


def test_dict_override_is_merged_in():
    cfg = load_resolved(["model=toy", "model.ffn_hidden_overrides={1:512}"])
    assert dict(cfg.model.ffn_hidden_overrides) == {1: 512}


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_load_config(case):
    _, overrides, _, message = case
    with pytest.raises(ConfigError) as err:
        load_resolved(overrides)
    assert str(err.value) == message
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, start", [
    (["model.foo=1"], "model.foo=1: unknown key; allowed keys at model: name, dim,"),
    (["+foo=1"], "+foo=1: unknown key"),
    (["~mesh"], "~mesh: schema keys cannot be deleted"),
    (["hardware=nope"], "hardware=nope: allowed a100, b200, cpu_epyc2, h100, h100_96gb, h200, "
                        "test_tables"),
    (["experiment=nope"], "experiment=nope: allowed"),
    (["model.dim=abc"], "model.dim=abc: allowed an integer"),
    (["solver.backend=gurobi"], "solver.backend=gurobi: allowed highs, cbc"),
    (["solver.name=foo"], "solver.name=foo: allowed approx, ilp, lp"),
    (["solver=ilp,lp"], "solver=ilp,lp: a list of values is a sweep"),
    (["constraints.inputs=P(avg)RR"], "constraints.inputs=P(avg)RR: Partial"),
    (["constraints.inputs=S(0)R"], "constraints.inputs=S(0)R: invalid placement"),
    (["constraints.nodes=[{match:primals_1,placement:'S(0)R'}]"],
     "constraints.nodes.0.placement=S(0)R: invalid placement 'S(0)R': 2 token(s) for a 3-d mesh"),
    (["constraints.nodes=[{match:x}]"], "constraints.nodes.0.placement: missing value"),
    (["constraints.param_memory.low=0.5", "constraints.param_memory.high=0.25"],
     "constraints.param_memory.high=0.25: allowed a fraction"),
    (["hardware.compute_efficiency=2"], "hardware.compute_efficiency=2.0"),
    (["results_dir="], "results_dir=: allowed a non-empty path"),
    (["a b"], "a b: not a valid override"),
    (["model.name=a/b"], "model.name=a/b: allowed letters"),
])
def test_more_bad_input_is_one_line(overrides, start):
    with pytest.raises(ConfigError) as err:
        load_resolved(overrides)
    assert str(err.value).startswith(start), str(err.value)
    assert "\n" not in str(err.value)


def _python_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    env.update(extra)
    return env


def _files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
@pytest.mark.parametrize("entry", ["pipeline", "pipeline.stages.runner"])
def test_bad_input_entry_points(case, entry, tmp_path, monkeypatch, capsys):
    """The ``main`` of ``python -m pipeline`` / ``python -m pipeline.cli solve``, called in
    this process (the interpreter start-up is tested once below): exit 2, exactly the
    one-line message on stderr, nothing written in the working directory."""
    import pipeline.__main__ as entry_main

    monkeypatch.chdir(tmp_path)
    args = [*case[1], f"results_dir={tmp_path / 'results'}"]
    if entry == "pipeline":
        with pytest.raises(SystemExit) as exit_:
            entry_main.main(args)
        code = exit_.value.code
    else:
        code = cli.main(["solve", *args])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.splitlines() == [case[3]] and out == ""
    assert _files_under(tmp_path) == []


def test_bad_sweep_and_bad_stage(tmp_path, monkeypatch, capsys):
    import pipeline.__main__ as entry_main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        entry_main.main(["-m", "mesh=8,2x0", "lazy_costs=true,false"])
    assert exit_.value.code == 2
    assert cli.main(["nosuch"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "mesh=2x0: allowed positive integers joined by ',' or 'x' (e.g. 2,4,8 or 2x4x8 or 8)",
        "stage=nosuch: allowed trace, topology, costs, solve, report"]
    assert _files_under(tmp_path) == []


def test_bad_input_through_the_real_interpreters(tmp_path):
    """``python -m pipeline`` and ``python -m pipeline.cli`` as a user runs them."""
    runs = [
        ([sys.executable, "-m", "pipeline", "mesh=2,0,8"],
         "mesh=2,0,8: allowed positive integers joined by ',' or 'x' (e.g. 2,4,8 or 2x4x8 or 8)"),
        ([sys.executable, "-m", "pipeline.stages.runner", "solve", "solver=foo"],
         "solver=foo: allowed approx, ilp, lp"),
    ]

    def run(cmd):
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True,
                              env=_python_env(), timeout=120)

    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(run, [cmd for cmd, _ in runs]))
    for proc, (_, line) in zip(procs, runs, strict=True):
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines() == [line]
    assert _files_under(tmp_path) == []


def test_the_config_layer_imports_no_torch(tmp_path):
    """``import pipeline.config`` (every Snakemake parse, every one-line error) and
    composing and resolving a config leave torch unimported: it costs seconds."""
    code = ("import sys\nimport pipeline.config\nassert 'torch' not in sys.modules\n"
            "pipeline.config.load_resolved(['model=toy', 'mesh=2x4', 'recipe=fsdp_tp',\n"
            "    'constraints.outputs=(S(0)R|-)', 'constraints.device_memory=80GiB'])\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, env=_python_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


_BAD_VALUES_WITHOUT_TORCH = """
import sys
import pipeline.__main__ as entry
import pipeline.cli
from pipeline.stages import runner
for args in (["mesh=2,0,8"], ["solver=foo"]):
    try:
        entry.main(args)
    except SystemExit as exit_:
        print(exit_.code)
print(runner.main(["trace", "mesh=2,0,8"]))
print(runner.main(["solve", "solver=foo"]))
print("torch" in sys.modules)
"""


def test_a_bad_value_exits_2_in_one_line_without_importing_torch(tmp_path):
    """The entry points validate before anything imports torch (or the stage code)."""
    proc = subprocess.run([sys.executable, "-c", _BAD_VALUES_WITHOUT_TORCH], cwd=tmp_path,
                          capture_output=True, text=True, env=_python_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2", "2", "2", "2", "False"]
    mesh = "mesh=2,0,8: allowed positive integers joined by ',' or 'x' (e.g. 2,4,8 or 2x4x8 or 8)"
    solver = "solver=foo: allowed approx, ilp, lp"
    assert proc.stderr.splitlines() == [mesh, solver, mesh, solver]
    assert _files_under(tmp_path) == []


# --------------------------------------------------------------------------- overrides


def test_normalise_overrides():
    assert normalise_overrides(["mesh=2,4,8", "mesh_names=a,b,c", "model=toy"]) == [
        "mesh='2,4,8'", "mesh_names=[a,b,c]", "model=toy"]
    assert normalise_overrides(["mesh=8,2x4"], multirun=True) == ["mesh=8,2x4"]
    assert normalise_overrides(["constraints.inputs=S(0)RR"]) == ["constraints.inputs='S(0)RR'"]
    assert normalise_overrides(["model.ffn_hidden_overrides={0:1}"]) == [
        "++model.ffn_hidden_overrides={0:1}"]


def test_sweep_overrides_expand_like_the_basic_sweeper():
    jobs = sweep_overrides(["lazy_costs=true,false", "mesh=8,2x4,2x4x8", "model=toy"])
    assert len(jobs) == 6
    # Hydra renders swept bools as True/False, which its grammar reads back as bools
    assert ["lazy_costs=True", "mesh=8", "model=toy"] in jobs
    assert ["lazy_costs=False", "mesh=2x4x8", "model=toy"] in jobs


@pytest.mark.parametrize("config, overrides", [
    ({"mesh": "2,4,8"}, ["mesh='2,4,8'"]),
    ({"mesh": 8}, ["mesh='8'"]),
    ({"mesh": ["2", "4", "8"]}, ["mesh='2x4x8'"]),
    ({"mesh_names": ["a", "b"]}, ["mesh_names=[a,b]"]),
    ({"mesh_names": "a,b"}, ["mesh_names=[a,b]"]),
    ({"lazy_costs": "true", "solver": "ilp"}, ["solver=ilp", "lazy_costs=true"]),
    ({"lazy_costs": True}, ["lazy_costs=true"]),
    ({"lazy_costs": None}, ["lazy_costs=null"]),
    ({"results_dir": "out dir"}, ["results_dir='out dir'"]),
    ({"overrides": "solver.backend=cbc solver.time_limit_s=60"},
     ["solver.backend=cbc", "solver.time_limit_s=60"]),
    ({"overrides": "constraints.inputs='S(0)RR'"}, ["constraints.inputs=S(0)RR"]),
])
def test_overrides_from_snakemake(config, overrides):
    assert overrides_from_snakemake(config) == overrides


@pytest.mark.parametrize("typed", [
    "mesh=2x4x8 'constraints.inputs=S(0)RR'",
    "'constraints.inputs=S(0)RR' mesh=2x4x8",
    "'constraints.inputs=S(0)RR' 'mesh=2x4x8'",
])
def test_quotes_snakemake_strips_are_read_back_from_the_command_line(typed):
    """Snakemake strips every leading/trailing quote of a --config value; the text as
    typed is taken from argv, so quoting at either end works."""
    from snakemake.cli import parse_config

    config = parse_config([f"overrides={typed}"])
    assert config["overrides"] != typed  # what Snakemake hands the Snakefile
    argv = ["snakemake", "--config", f"overrides={typed}"]
    assert sorted(overrides_from_snakemake(config, argv)) == [
        "constraints.inputs=S(0)RR", "mesh=2x4x8"]


def test_unbalanced_quotes_in_overrides_are_one_line():
    with pytest.raises(ConfigError, match=r"^overrides=a=1 'b=2: No closing quotation"):
        overrides_from_snakemake({"overrides": "a=1 'b=2"})


def test_overrides_from_snakemake_refuses_unknown_keys():
    with pytest.raises(ConfigError, match=r"^meshes=8: unknown --config key; allowed model, "):
        overrides_from_snakemake({"meshes": 8})


@pytest.mark.parametrize("value, auto, path, always, never", [
    ("toy", "toy", "toy", "'toy'", "toy"),
    ("2x4", "'2x4'", "2x4", "'2x4'", "2x4"),
    ("/tmp/a b", "'/tmp/a b'", "'/tmp/a b'", "'/tmp/a b'", "/tmp/a b"),
    ("results/x-1.0+y", "'results/x-1.0+y'", "results/x-1.0+y", "'results/x-1.0+y'",
     "results/x-1.0+y"),
    ("it's", "'it\\'s'", "'it\\'s'", "'it\\'s'", "it's"),
    # Hydra reads a backslash literally unless backslashes precede a quote or the end
    ("a\\b", "'a\\b'", "'a\\b'", "'a\\b'", "a\\b"),
    ("a\\", "'a\\\\'", "'a\\\\'", "'a\\\\'", "a\\"),
    ("a\\'b", "'a\\\\\\'b'", "'a\\\\\\'b'", "'a\\\\\\'b'", "a\\'b"),
    ("S(0)RR", "'S(0)RR'", "'S(0)RR'", "'S(0)RR'", "S(0)RR"),
    ("null", "'null'", "'null'", "'null'", "null"),
    ("True", "'True'", "'True'", "'True'", "True"),
    (None, "null", "null", "null", "null"),
    (False, "false", "false", "false", "false"),
    (8, "8", "8", "8", "8"),
    (1e-05, "1e-05", "1e-05", "1e-05", "1e-05"),
    ([2, "a b"], "[2,'a b']", "[2,'a b']", "[2,'a b']", "[2,a b]"),
    ({0: 4096, "k": "x/y"}, "{0:4096,k:'x/y'}", "{0:4096,k:x/y}", "{0:4096,k:'x/y'}",
     "{0:4096,k:x/y}"),
])
def test_override_value_quotes_each_way(value, auto, path, always, never):
    """The one override renderer in its four modes (worked out by hand)."""
    assert override_value(value) == auto
    assert override_value(value, quote="path") == path
    assert override_value(value, quote="always") == always
    assert override_value(value, quote="never") == never
    assert override_value(OmegaConf.create({"v": value}).v if isinstance(value, (list, dict))
                          else value, quote="never") == never


@pytest.mark.parametrize("text", ["toy", "2x4", "2,4,8", "/tmp/a b", "it's", "a\\b",
                                  "a\\", "a\\'b", "a\\\\'", "S(0)RR", "(S(0)R|-)", "null",
                                  "TRUE", "inf", "1e10",
                                  "a=b", "", " x ", "${oops}"])
@pytest.mark.parametrize("quote", ["auto", "always"])
def test_override_value_is_read_back_by_hydra_as_the_same_string(text, quote):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_override(f"k={override_value(text, quote)}")
    assert parsed.value() == text


def test_override_value_refuses_what_it_cannot_render():
    with pytest.raises(ValueError, match=r"^quote=sometimes: allowed auto, path, always, never$"):
        override_value("x", quote="sometimes")
    with pytest.raises(TypeError):
        override_value({1, 2})
    assert override_value({1}, quote="never") == "{1}"


@pytest.mark.parametrize("overrides", [
    [], ["model=toy", "solver=ilp", "mesh=8"], ["model=llama70b", "solver=lp"],
    ["model.ffn_hidden_overrides={0:4096}", "constraints.inputs=S(0)R",
     "constraints.nodes=[{match:'it\\'s',placement:'(S(0)R|-)'}]", "mesh=2x4",
     "mesh_names=[a,b]", "results_dir=/tmp/a b", "constraints.param_memory=null",
     "hardware.intra_node.bandwidth=1e11", "solver.time_limit_s=60"],
    ["results_dir='/tmp/a\\b\\\\'", "constraints.nodes=[{match:'layers\\.0',placement:RRR}]"],
])
def test_stage_overrides_rebuild_each_stage_key(overrides):
    cfg = load_resolved(overrides)
    dirs = stage_dirs(cfg)
    for stage in STAGES:
        again = load_resolved(stage_overrides(cfg, stage))
        assert stage_dirs(again).of(stage) == dirs.of(stage), stage


def test_stage_overrides_of_trace_ignore_the_solver():
    a = load_resolved(["solver=approx"])
    b = load_resolved(["solver=ilp", "mesh=8", "hardware.kernel_floor_us=1"])
    assert stage_overrides(a, "trace") == stage_overrides(b, "trace")
    assert stage_overrides(a, "solve") != stage_overrides(b, "solve")


def test_stage_overrides_pass_workers_on_to_the_stages_that_fork():
    cfg = load_resolved(["model=toy", "workers=1"])
    assert "workers=1" not in stage_overrides(cfg, "trace")
    for stage in ("topology", "costs", "solve"):
        assert stage_overrides(cfg, stage)[-1] == "workers=1"
        assert load_resolved(stage_overrides(cfg, stage)).workers == 1
    assert not any(o.startswith("workers=") for o in stage_overrides(
        load_resolved(["model=toy"]), "solve"))  # the default 0 is not repeated


# --------------------------------------------------------------------------- keys and paths


def test_config_hash_is_sha256_of_canonical_json():
    obj = {"b": [1, 2.5, None], "a": {"y": True, "x": "s"}}
    text = '{"a":{"x":"s","y":true},"b":[1,2.5,null]}'
    assert config_hash(obj) == hashlib.sha256(text.encode()).hexdigest()[:8]


def test_stage_dirs_layout():
    cfg = load_resolved(["model=toy", "mesh=2,4,8", "solver=approx"])
    d = stage_dirs(cfg)
    parts = d.solve.parts
    assert parts[:2] == ("results", "runs")
    assert parts[2].startswith("toy-") and parts[3].startswith("2x4x8-")
    assert parts[4].startswith("h100-") and parts[5] == "lazy"
    assert parts[6].startswith("approx-")
    assert all(len(p.rsplit("-", 1)[1]) == 8 for p in (parts[2], parts[3], parts[4], parts[6]))
    assert d.trace == Path(*parts[:3]) and d.topology == Path(*parts[:4])
    assert d.costs == Path(*parts[:6]) and d.report == Path("results/report")
    model = OmegaConf.to_container(cfg.model)
    assert model.pop("microbatches") == 1  # the default stays out of the key
    assert parts[2] == "toy-" + config_hash({"model": model})
    accumulated = stage_dirs(load_resolved(["model=toy", "model.microbatches=2"]))
    assert accumulated.trace.name != d.trace.name
    assert stage_dirs(load_resolved(["solver=ilp", "model=toy"])).costs.name == "eager"


def _dirs(overrides):
    return stage_dirs(load_resolved(overrides))


def test_a_changed_value_gives_a_new_path_below_its_level_only():
    base = _dirs(["model=toy"])
    model = _dirs(["model=toy", "model.n_layers=3"])
    assert model.trace != base.trace
    mesh = _dirs(["model=toy", "mesh=2x4"])
    assert (mesh.trace, mesh.topology != base.topology) == (base.trace, True)
    names = _dirs(["model=toy", "mesh_names=[a,b,c]"])
    assert names.trace == base.trace and names.topology != base.topology
    hw = _dirs(["model=toy", "hardware.kernel_floor_us=5"])
    assert hw.topology == base.topology and hw.costs != base.costs
    eager = _dirs(["model=toy", "lazy_costs=false"])
    assert eager.costs.parent == base.costs.parent and eager.costs.name == "eager"
    solver = _dirs(["model=toy", "solver.max_iters=100"])
    assert solver.costs == base.costs and solver.solve != base.solve
    check = _dirs(["model=toy", "optimality_check=true"])
    assert check.costs == base.costs and check.solve != base.solve
    ilp, lp = _dirs(["model=toy", "solver=ilp"]), _dirs(["model=toy", "solver=lp"])
    assert ilp.costs == lp.costs and ilp.solve != lp.solve
    label = _dirs(["model=toy", "revision_label=v1", "experiment=null"])
    assert label == base
    assert _dirs(["model=toy", "workers=1"]) == base  # the same results for any workers
    unfused = _dirs(["model=toy", "costs.fuse_pointwise=false"])
    assert unfused.topology == base.topology and unfused.costs != base.costs
    assert _dirs(["model=toy", "costs.fuse_pointwise=true"]) == base  # the default
    compiled = _dirs(["model=toy", "costs.compile=true"])
    assert compiled.topology == base.topology and compiled.costs != base.costs
    assert _dirs(["model=toy", "costs.compile=false"]) == base  # the default


def test_fusion_credit_only_when_compiled():
    """The pointwise-fusion credit is on only for a compiled step (``costs.compile``)
    that keeps ``costs.fuse_pointwise`` (default true); eager (the default) fuses
    nothing."""
    from pipeline.config.readers import fuse_pointwise_config

    on = {(c, f): fuse_pointwise_config(load_resolved(
        ["model=toy", f"costs.compile={c}", f"costs.fuse_pointwise={f}"]))
        for c in ("true", "false") for f in ("true", "false")}
    assert on == {("true", "true"): True, ("true", "false"): False,
                  ("false", "true"): False, ("false", "false"): False}
    assert fuse_pointwise_config(load_resolved(["model=toy"])) is False


def test_stage_dirs_are_the_same_across_processes_and_hash_seeds(tmp_path):
    code = ("import json; from pipeline.config import load_resolved, stage_dirs; "
            "d = stage_dirs(load_resolved(['model=toy', 'mesh=2x4x8', 'solver=ilp'])); "
            "print(json.dumps([str(d.trace), str(d.topology), str(d.costs), str(d.solve)]))")

    def run(seed):
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                              text=True, env=_python_env(PYTHONHASHSEED=seed), timeout=120,
                              check=True)
        return json.loads(proc.stdout)

    with ThreadPoolExecutor(max_workers=2) as pool:
        a, b = pool.map(run, ["1", "2"])
    here = _dirs(["model=toy", "mesh=2x4x8", "solver=ilp"])
    assert a == b == [str(here.trace), str(here.topology), str(here.costs), str(here.solve)]


def _tree_copy(tmp_path):
    """A copy of this checkout's ``pipeline/`` package under ``tmp_path``."""
    import shutil

    from pipeline.core.runtime import PROJECT_ROOT

    shutil.copytree(PROJECT_ROOT / "pipeline", tmp_path / "pipeline",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.parametrize("stage, imported, not_imported", [
    # the solver layer runs in solve, not in the trace or topology
    ("solve", "pipeline/solvers/trws.py", "pipeline/tools/shapes.py"),
    ("costs", "pipeline/core/parallel.py", "pipeline/solvers/trws.py"),
    ("costs", "pipeline/dtensor/placements.py", "pipeline/stages/report/picture.py"),
    ("topology", "pipeline/stages/topology/extra_strategies.py", "pipeline/costmodel/comm.py"),
    ("trace", "pipeline/stages/trace/stamp.py", "pipeline/stages/topology/pins.py"),
    # a model family is imported by name, not by an import statement
    ("trace", "pipeline/models/hf.py", "pipeline/costmodel/comm.py"),
])
def test_stage_code_hash_is_what_the_stage_imports(tmp_path, stage, imported, not_imported):
    """Editing a module the stage imports (transitively, lazily too) moves its hash;
    editing one it does not import leaves it."""
    root = _tree_copy(tmp_path)
    first = stage_code_hash(stage, root=root)
    assert first == stage_code_hash(stage, root=root)
    with (root / not_imported).open("a") as f:
        f.write("\n# an edit\n")
    assert stage_code_hash(stage, root=root) == first
    with (root / imported).open("a") as f:
        f.write("\n# an edit\n")
    assert stage_code_hash(stage, root=root) != first


def test_stage_code_hash_follows_a_new_import(tmp_path):
    """A module that starts importing another brings it into the hash."""
    root = _tree_copy(tmp_path)
    before = stage_code_hash("trace", root=root)
    with (root / "pipeline/tools/shapes.py").open("a") as f:
        f.write("\n# an edit\n")
    assert stage_code_hash("trace", root=root) == before
    with (root / "pipeline/stages/trace/stamp.py").open("a") as f:
        f.write("\ndef _probe():\n    from pipeline.tools import shapes  # noqa: F401\n")
    added = stage_code_hash("trace", root=root)
    assert added != before
    with (root / "pipeline/tools/shapes.py").open("a") as f:
        f.write("\n# another edit\n")
    assert stage_code_hash("trace", root=root) != added
    assert len(stage_code_hash("trace")) == 16


# --------------------------------------------------------------------------- stage runs


@pytest.fixture
def fake_stages(monkeypatch):
    """Replace the stage functions by ones that write their artifacts and log calls."""
    calls: list[str] = []

    def fake(stage, cfg, dirs):
        from pipeline.core.artifacts import stage_outputs

        calls.append(stage)
        time.sleep(0.01)
        dirs.of(stage).mkdir(parents=True, exist_ok=True)
        for artifact in stage_outputs(stage, bool(cfg.lazy_costs)):  # sentinel last
            artifact.path(dirs.of(stage)).write_text(stage)

    monkeypatch.setattr(cli, "_call_stage", fake)
    return calls


def test_run_pipeline_reuses_current_artifacts(tmp_path, fake_stages, monkeypatch):
    from pipeline.stages.runner import run_pipeline

    monkeypatch.chdir(tmp_path)
    cfg = load_resolved(["model=toy"])
    timer = run_pipeline(cfg)
    assert fake_stages == list(STAGES)
    assert {"trace", "topology", "cost_build", "solve", "report", "wall"} <= set(timer.seconds)
    fake_stages.clear()
    run_pipeline(cfg)
    assert fake_stages == ["report"]
    fake_stages.clear()
    run_pipeline(load_resolved(["model=toy", "solver=lp", "lazy_costs=false"]))
    assert fake_stages == ["costs", "solve", "report"]
    # a code change of one stage reruns it and everything after it
    fake_stages.clear()
    dirs = stage_dirs(cfg)
    (dirs.topology / ".code").write_text("old\n")
    run_pipeline(cfg)
    assert fake_stages == ["topology", "costs", "solve", "report"]
    # an input newer than the artifact reruns the stage
    fake_stages.clear()
    later = time.time() + 10
    os.utime(cli.sentinel(dirs, "costs"), (later, later))
    run_pipeline(cfg)
    assert fake_stages == ["solve", "report"]


def test_concurrent_writers_of_one_stage_run_it_once(tmp_path, fake_stages, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_resolved(["model=toy"])
    dirs = stage_dirs(cfg)
    ran = []
    threads = [threading.Thread(target=lambda: ran.append(cli.run_stage("trace", cfg, dirs)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake_stages == ["trace"] and sorted(ran) == [False, False, False, True]


def test_stage_without_its_sentinel_fails(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_call_stage", lambda stage, cfg, dirs: None)
    cfg = load_resolved(["model=toy"])
    with pytest.raises(FileNotFoundError, match="without writing"):
        cli.run_stage("trace", cfg, stage_dirs(cfg))


_FAKE_MAIN = """
import sys
from pipeline.stages import runner as cli
def fake(stage, cfg, dirs):
    p = cli.sentinel(dirs, stage); p.parent.mkdir(parents=True, exist_ok=True); p.write_text("x")
    if stage == "report":
        (dirs.report / "placements.parquet").write_text("x")
        (dirs.report / "redistributions.parquet").write_text("x")
cli._call_stage = fake
from pipeline.__main__ import main
sys.argv = ["pipeline", *sys.argv[1:]]
main()
"""


def test_hydra_writes_nothing_on_a_run_and_only_its_sweep_dir_on_a_multirun(tmp_path):
    def run(cwd, *args):
        cwd.mkdir()
        proc = subprocess.run([sys.executable, "-c", _FAKE_MAIN, *args], cwd=cwd,
                              capture_output=True, text=True, env=_python_env(), timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc, _files_under(cwd)

    with ThreadPoolExecutor(max_workers=2) as pool:
        single = pool.submit(run, tmp_path / "one", "model=toy", "mesh=2,4,8")
        multi = pool.submit(run, tmp_path / "multi", "-m", "model=toy", "mesh=8,2x4",
                            "lazy_costs=true,false")
        (proc, files), (mproc, mfiles) = single.result(), multi.result()
    assert {f.split("/")[0] for f in files} == {"results"}
    assert not any(f.startswith("results/hydra") for f in files)
    assert "run record: results/runs/toy-" in proc.stdout
    sweep = [f for f in mfiles if f.startswith("results/hydra/multirun/")]
    assert any(f.endswith("multirun.yaml") for f in sweep)
    assert {f.split("/")[0] for f in mfiles} == {"results"}
    runs = [f for f in mfiles if f.endswith("run.json")]
    assert len(runs) == 4 and mproc.stdout.count("run record:") == 4


def test_mesh_values_are_plain_ints():
    cfg = load_resolved(["mesh=2x4"])
    assert all(type(d) is int for d in cfg.mesh) and math.prod(cfg.mesh) == 8


def _a_file(d, *below):
    (d / "f").write_text("x")
    return d.joinpath("f", *below)


@pytest.mark.parametrize("make, expect", [
    (lambda d: _a_file(d), "it is not a directory"),
    (lambda d: _a_file(d, "sub"), "which is not a directory"),
    (lambda d: d / ("n" * 256), "at most 255 bytes (one is 256)"),
])
def test_an_unusable_results_dir_is_one_line_before_any_work(tmp_path, make, expect):
    """A results_dir that is a file, lies under a file, or has a name too long for the
    file system: exit 2, one line naming the key and what is allowed, nothing written."""
    bad = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = subprocess.run([sys.executable, "-m", "pipeline", "model=toy", "mesh=2",
                           f"results_dir={bad}"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("results_dir=") and expect in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # a path that does not exist yet under a directory is fine (it is created by the run)
    from pipeline.config.validate import check_results_dir

    check_results_dir(str(tmp_path / "new" / "runs"))
