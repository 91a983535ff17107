"""Paths and values reach a shell only quoted: a ``results_dir`` with spaces, quotes,
``;``, ``$(...)``, backquotes or non-ASCII runs inside itself, through a real Snakemake
run and ``python -m pipeline``, or is refused in one line with exit status 2 (a line
break, NUL; braces under Snakemake); nothing appears outside it either way.

Property-based (hypothesis) over the directory name, few examples (4 explicit, 2 drawn:
each costs ~15 s): each is a real
Snakemake run of ``model=toy mesh=2`` (its trace, topology and costs copied from the
session's shared run, so the solve and report jobs run, both shell commands writing
their logs under ``results_dir``) and a real ``python -m pipeline`` run after it. The
unit tests below check the pieces (raw ``--config`` text, the cluster guard).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from fixtures import SNAKEFILE, child_env
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from pipeline.config import ConfigError, load_resolved
from pipeline.config.overrides import override_value
from pipeline.config.snakemake import (
    check_cluster_config,
    check_workflow_paths,
    config_entries,
    job_command_problem,
    overrides_from_snakemake,
)

#: What a drawn directory name is made of: the shell's special characters, quotes,
#: non-ASCII, a tab. No ``/`` (one directory below the working directory, never ``..``)
#: and no braces (Hydra interpolations ``${...}``; braces are an explicit example).
ALPHABET = st.sampled_from(list("ab xyz019_-.;$()`'\"\\|&<>*?!#=,~%^@:\t") + ["é", "中", "😀"])
RUN_STAGES = ("trace", "topology", "costs")


def _snakemake_reads_it(value: str) -> bool:
    """False for a value Snakemake's own ``--config`` parser fails on before the workflow
    is read (``snakemake.cli.parse_config`` asserts when YAML reads it as nothing, e.g. a
    comment ``#x``): not ours to refuse."""
    import yaml

    text = value.strip("'\"")
    if text == "":
        return True
    try:
        return yaml.load(text, Loader=yaml.loader.BaseLoader) is not None
    except yaml.YAMLError:
        return True


def _files(root: Path, results_dir: str) -> set[str]:
    """Every path under ``root`` outside ``results_dir`` and Snakemake's ``.snakemake``."""
    inside = root / results_dir
    out = set()
    for p in root.rglob("*"):
        if p == inside or inside in p.parents:
            continue
        rel = p.relative_to(root)
        if rel.parts[0] != ".snakemake":
            out.add(str(rel))
    return out


def _seed_stages(toy_results, dest: Path) -> None:
    """The trace, topology and costs of the shared ``mesh=2`` run, copied into ``dest``
    (a results directory) at the same relative paths, times and stamps kept."""
    run = toy_results.run("mesh=2")
    src_root = Path(str(run.cfg.results_dir))
    for stage in RUN_STAGES:
        src = Path(run.dirs.of(stage))
        out = dest / src.relative_to(src_root)
        out.mkdir(parents=True, exist_ok=True)
        for path in src.iterdir():
            if path.is_file() and path.name != ".lock":
                shutil.copy2(path, out / path.name)


def _check(proc: subprocess.CompletedProcess, workdir: Path, name: str, what: str) -> bool:
    """Ran inside ``name`` (True) or refused in one line naming results_dir (False)."""
    assert "Traceback" not in proc.stderr, (what, proc.stderr[-3000:])
    if proc.returncode == 2:
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("results_dir="), (what, proc.stderr[-2000:])
        assert "allowed" in last
        return False
    assert proc.returncode == 0, (what, proc.stderr[-3000:])
    records = list((workdir / name / "runs").glob("*/*/*/*/*/run.json"))
    assert len(records) == 1, (what, records)
    assert (workdir / name / "report" / "runs.parquet").is_file()
    return True


@pytest.mark.slow
@pytest.mark.toy_runs(("mesh=2",))
def test_results_dir_reaches_no_shell_unquoted(toy_results):
    @settings(max_examples=1, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.text(ALPHABET, min_size=1, max_size=12))
    @example("r;touch PWNED;x")
    @example("a b'$(touch P1)`touch P2`\"é")
    @example("line\nbreak")
    @example("a{b}")
    def check(name: str) -> None:
        assume(name not in (".", "..") and _snakemake_reads_it(name))
        usable = bool(name.strip()) and "\n" not in name  # else one line, exit 2
        workdir = Path(tempfile.mkdtemp(prefix="shell-safety-"))
        try:
            if "\n" not in name:
                _seed_stages(toy_results, workdir / name)
            before = _files(workdir, name)
            env = child_env("1")
            smk = subprocess.run(
                [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE),
                 "--directory", str(workdir), "--cores", "1", "--config", "model=toy",
                 "mesh=2", f"results_dir={name}"],
                capture_output=True, text=True, env=env, timeout=900)
            ran = _check(smk, workdir, name, "snakemake")
            braces = "{" in name or "}" in name
            assert ran == (usable and not braces), smk.stderr[-2000:]
            py = subprocess.run(
                [sys.executable, "-m", "pipeline", "model=toy", "mesh=2",
                 f"results_dir={override_value(name, quote='always')}"],
                cwd=workdir, capture_output=True, text=True, env=env, timeout=900)
            ran = _check(py, workdir, name, "python -m pipeline")
            assert ran == usable
            if not ran:
                assert len(py.stderr.strip().splitlines()) == 1, py.stderr
            assert _files(workdir, name) == before
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    check()


# --------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize("typed", [
    "r;touch PWNED;x", "'quoted'", "a #b", "[a]", "a: b", "- x", "123", "true", "é`x`"])
def test_snakemake_config_keeps_results_dir_as_typed(typed):
    """Snakemake strips quotes and reads YAML (``a #b`` -> ``a``, ``[a]`` -> a list): the
    text on the command line is what becomes results_dir."""
    from snakemake.cli import parse_config

    parsed = parse_config([f"results_dir={typed}"])
    overrides = overrides_from_snakemake(parsed, ["snakemake", "--config", "model=toy",
                                                  f"results_dir={typed}"])
    assert load_resolved(overrides).results_dir == typed


def test_a_line_break_or_nul_in_results_dir_is_one_line():
    for value, held in (("a\nb", "\\n"), ("a\x00b", "\\x00"), ("a\u2028b", "\\u2028")):
        with pytest.raises(ConfigError) as err:
            load_resolved([f"results_dir={override_value(value, quote='always')}"])
        text = str(err.value)
        assert "\n" not in text and text == (
            f"results_dir={value.encode('unicode_escape').decode()}: allowed a path on one "
            f"line, without NUL or line breaks (it holds {held})")
    assert load_resolved(["results_dir='a\tb $(x) `y` é'"]).results_dir == "a\tb $(x) `y` é"


def test_braces_are_refused_by_the_workflow_only():
    cfg = load_resolved(["results_dir='a{b}'"])
    with pytest.raises(ConfigError, match=r"^results_dir=a\{b\}: \{ and \} mark wildcards"):
        check_workflow_paths(cfg)
    check_workflow_paths(load_resolved(["results_dir='a b;$(c)'"]))


@pytest.mark.parametrize("entry, local, wrapped", [
    ("results_dir=a b;c", True, True),
    ("results_dir=a'b", True, True),
    ("results_dir=a\"b", True, True),
    ("results_dir=é", True, True),
    ("results_dir=a$(touch X)", True, False),  # repr's single quotes; --wrap="..." expands
    ("results_dir=a`x`", True, False),
    ("results_dir=a\\b", False, False),        # repr doubles the backslash
    ("results_dir=a'$(touch X)", False, False),  # repr's double quotes expand $(...)
    ("results_dir=a\tb", False, False),        # repr writes \t
])
def test_what_a_cluster_job_receives_as_typed(entry, local, wrapped):
    assert (job_command_problem(entry, wrapped=False) is None) == local
    assert (job_command_problem(entry, wrapped=True) is None) == wrapped
    argv = ["snakemake", "-j", "1", "--config", "model=toy", entry, "--executor", "slurm"]
    assert config_entries(argv) == ["model=toy", entry]
    if not wrapped:
        with pytest.raises(ConfigError) as err:
            check_cluster_config(argv, "slurm", True)
        assert str(err.value).endswith(
            "(--executor slurm); allowed as it is with a local run, or in a --configfile")
        assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_cluster_run_refuses_what_its_jobs_would_not_receive(tmp_path):
    """``--executor slurm`` (no cluster needed: refused before anything is submitted)."""
    pytest.importorskip("snakemake_executor_plugin_slurm")
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--directory",
         str(tmp_path), "--executor", "slurm", "--jobs", "1", "--config", "model=toy",
         "mesh=2", "results_dir=r$(touch PWNED)"],
        capture_output=True, text=True, env=child_env("1"), timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "results_dir=r$(touch PWNED): the slurm executor passes each job's command in sbatch "
        "--wrap=\"...\", where the shell expands $")
    assert not list(tmp_path.rglob("PWNED"))
    assert not (tmp_path / "r$(touch PWNED)").exists()
