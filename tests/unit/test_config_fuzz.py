"""Fuzzing the config entry points (hypothesis): mesh strings, mesh names, placements and
whole override lists either resolve or raise :class:`~pipeline.config.ConfigError` with
one line; never another exception (a traceback for the user). Few examples, no
deadline: Hydra composes each one (~0.1 s)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import ConfigError, load_resolved, normalise_overrides, parse_mesh

FUZZ = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def resolves_or_one_line(overrides: list[str], multirun: bool = False) -> None:
    try:
        load_resolved(["model=toy", *normalise_overrides(overrides, multirun)])
    except ConfigError as err:
        text = str(err)
        assert text and "\n" not in text and "Traceback" not in text, text


MESH_TEXT = st.text("0123456789xX, []()-+.e", max_size=12)
NAMES = st.lists(st.text("abcdpt_09 -", max_size=4), max_size=5)
PLACEMENT = st.text("RSP()0123-,|(MNp", max_size=14)
KEYS = st.sampled_from([
    "mesh", "mesh_names", "solver", "solver.tol", "solver.max_iters", "solver.backend",
    "hardware.peak_flops_bf16", "hardware.intra_node.all_gather_bw", "model.batch_size",
    "model.seq_len", "constraints.inputs", "constraints.outputs", "lazy_costs",
    "constraints.param_memory.low", "constraints.device_memory", "results_dir",
    "revision_label", "nosuch.key", "model.dim", "repeated_layers"])
VALUES = st.one_of(st.text("abcxyz0123456789.,-+eE[]{}()'\"=: _", max_size=10),
                   st.sampled_from(["inf", "-inf", "nan", "null", "true", "1e400", "0",
                                    "-1", "2x4", "[]", "{}", "S(0)", "''", "${oops}"]))


@FUZZ
@given(MESH_TEXT)
def test_mesh_strings(text):
    try:
        dims = parse_mesh(text)
    except ConfigError as err:
        assert "\n" not in str(err) and str(err).startswith("mesh=")
    else:
        assert dims and all(isinstance(d, int) and d >= 1 for d in dims)
    resolves_or_one_line([f"mesh={text}"])


@FUZZ
@given(st.sampled_from(["8", "2x4", "2x4x8", "2x2x2x2"]), NAMES)
def test_mesh_names(mesh, names):
    resolves_or_one_line([f"mesh={mesh}", f"mesh_names=[{','.join(names)}]"])


@FUZZ
@given(st.sampled_from(["8", "2x4", "2x4x8"]),
       st.sampled_from(["constraints.inputs", "constraints.outputs"]), PLACEMENT)
def test_placements(mesh, key, text):
    resolves_or_one_line([f"mesh={mesh}", f"{key}={text}"])


@FUZZ
@given(st.lists(st.tuples(KEYS, VALUES), max_size=4), st.booleans())
def test_override_lists(pairs, multirun):
    resolves_or_one_line([f"{k}={v}" for k, v in pairs], multirun)


@pytest.mark.parametrize("override", ["mesh=2x4x8", "mesh_names=[a,b,c]"])
def test_a_valid_value_resolves(override):
    load_resolved(["model=toy", "mesh=2x4x8", override])
