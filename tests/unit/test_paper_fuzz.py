"""Property-based: ``build_paper`` on runs tables with missing optional columns, null and
NaN values and mixed revision labels writes its artifacts or fails with one
:class:`~pipeline.tools.paper.PaperError` line, never another exception."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from paper_runs import synthetic_runs

from pipeline.tools import paper

#: Columns of a runs-table row the paper reads but a record may lack (an older record, a
#: solver that reports no gap, a run without a revision label).
OPTIONAL = ("revision_label", "git.revision", "git.dirty", "gap", "certified", "status",
            "peak_rss_bytes.max", "phases.factor_build", "phases.topology", "objective",
            "config_json", "hardware")

NULLS = st.sampled_from([None, math.nan])


@st.composite
def damaged(draw, base):
    runs = base.copy()
    for col in draw(st.lists(st.sampled_from(OPTIONAL), unique=True, max_size=4)):
        runs = runs.drop(columns=[col])
    for col in draw(st.lists(st.sampled_from([c for c in OPTIONAL if c in runs]),
                             unique=True, max_size=4)):
        rows = draw(st.lists(st.integers(0, len(runs) - 1), unique=True, min_size=1))
        runs[col] = runs[col].astype(object)
        for r in rows:
            runs.iat[r, runs.columns.get_loc(col)] = draw(NULLS)
    if "revision_label" in runs and draw(st.booleans()):  # mixed labels: text and null
        labels = draw(st.lists(st.one_of(st.none(), st.just(math.nan),
                                         st.text("abcXY-1", min_size=1, max_size=6)),
                               min_size=len(runs), max_size=len(runs)))
        runs["revision_label"] = labels
    return runs


@pytest.fixture(scope="module")
def experiment():
    return paper.load_experiment([])


@pytest.mark.slow
def test_build_paper_on_random_run_tables(experiment, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("paper_fuzz"))
    base = synthetic_runs(experiment)
    base = base.assign(run_key=[paper.run_key(d) for d in base["solve_dir"]])

    # a build renders four figures (~1 s): few examples, no shrinking
    @settings(max_examples=5, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow])
    @given(damaged(base))
    def check(runs):
        try:
            written = paper.build_paper(runs, experiment)
        except paper.PaperError as err:
            assert "\n" not in str(err)
            return
        assert written and all(p.is_file() for p in written)

    check()


def test_mixed_revision_labels_in_the_footer(experiment):
    """The issue's crash: a runs table with and without ``revision_label``
    (``TypeError: unsupported operand type(s) for +=: 'float' and 'str'``)."""
    runs = synthetic_runs(experiment).head(3).copy()
    runs["revision_label"] = ["X", None, math.nan]
    footer = paper.describe_runs(runs)
    assert footer.endswith("git X, 01234567")
