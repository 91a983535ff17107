"""Verify of pipelined plans (pipeline/verify/pipelined.py): toy with ``pp = 2`` on mesh
``2`` (GPipe, 1F1B, interleaved 1F1B with 2 virtual stages per rank; 4 microbatches) and
on mesh ``2x2`` named ``pp,dp`` (1F1B), each stage run by torch.distributed.pipelining on
gloo processes and compared with the unsharded step.

Independent checks: the reference loss is the loss this test computes from the same
seeded model; each microbatch loss the schedule returned equals the unsharded model's
loss on that slice of the batch (the schedule split the batch as the plan says, in
order); every parameter of the model was compared; the per-rank layer ranges are the
plan file's; each boundary carried one activation forward and one gradient back per
microbatch, of one replica's microbatch of hidden states (counted here by hand). A
stage whose weight is perturbed fails the check (it can fail). Bad
input (interleaved with a layer count that does not split into 2 x pp chunks; a plan
file whose pipeline section was edited; ``--measure``, not built for it): one line,
exit 2, nothing written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_resolved

ROOT = Path(__file__).resolve().parents[2]
TINY = ("model=toy", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2",
        "model.multiple_of=32", "model.vocab_size=64", "model.seq_len=16",
        "model.batch_size=8", "pipeline.microbatches=4")
CASES = {
    "gpipe": ("mesh=2", "mesh_names=[pp]", "pipeline.schedule=gpipe"),
    "1f1b": ("mesh=2", "mesh_names=[pp]", "pipeline.schedule=1f1b"),
    "interleaved": ("mesh=2", "mesh_names=[pp]", "pipeline.schedule=interleaved_1f1b",
                    "pipeline.virtual_stages=2", "model.n_layers=4"),
    "1f1b_dp": ("mesh=2,2", "mesh_names=[pp,dp]", "pipeline.schedule=1f1b"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ppverify")


def _cfg(results: Path, case: str):
    return load_resolved([*TINY, *CASES[case], f"results_dir={results}"])


def _unsharded(cfg):
    """The seeded model's loss on the whole batch and on each of the microbatches of
    each data-parallel replica, computed here in one process."""
    import torch
    from omegaconf import OmegaConf

    from pipeline.dtensor.cpu_kernels import cpu_kernels
    from pipeline.verify.models import build_real_model, real_inputs

    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model = build_real_model(model_cfg, 0)
    tokens, labels = real_inputs(model_cfg, 0)

    with torch.no_grad(), cpu_kernels():
        whole = float(model(tokens, labels))
        replicas = int(cfg.mesh[1]) if len(cfg.mesh) > 1 else 1
        m = int(cfg.pipeline.microbatches)
        size = tokens.shape[0] // (replicas * m)
        first = [float(model(tokens[i * size:(i + 1) * size], labels[i * size:(i + 1) * size]))
                 for i in range(m)]  # replica 0's microbatches
    return whole, first, [n for n, _ in model.named_parameters()]


def _check(record: dict, cfg, plan_path: Path) -> None:
    from pipeline.verify.run import RTOL

    pp = record["pipelined"]
    assert record["ok"] and pp["ok"], pp.get("error")
    whole, micro, names = _unsharded(cfg)
    assert pp["loss"]["reference"] == pytest.approx(whole, rel=1e-6)
    assert pp["loss"]["rel_diff"] <= RTOL
    assert pp["microbatch_losses"] == pytest.approx(micro, rel=1e-5)
    assert sorted(pp["grads"]) == sorted(names) and not pp["grads_missing"]
    assert all(g["rel_diff"] <= RTOL for g in pp["grads"].values())
    assert pp["max_rel_diff"] <= RTOL
    section = json.loads(plan_path.read_text())["pipeline"]
    want = [[[st["stage"], st["layers"]] for st in section["stages"] if st["rank"] == r]
            for r in range(section["degree"])]
    got = [[[st["stage"], st["layers"]] for st in rank["stages"]] for rank in pp["ranks"]]
    assert got == want
    assert pp["schedule"] == str(cfg.pipeline.schedule)
    assert pp["microbatches"] == 4
    assert pp["virtual_stages"] == int(cfg.pipeline.virtual_stages)
    assert record["processes"] == int(cfg.mesh[0]) * pp["replicas"]
    # sends: every microbatch's activation forward and gradient back across each boundary,
    # one sample of 16 tokens x dim 32 per replica and microbatch (8 / (replicas x 4))
    n, m = len(section["stages"]), 4
    sends = pp["sends"]
    assert sends["counted"] == {str(s): {"activation": m * (s < n - 1), "gradient": m * (s > 0)}
                                for s in range(n)}
    samples = 8 // (pp["replicas"] * m)
    assert sends["elements_per_send"] == [samples * 16 * 32]
    assert sends["planned_elements_per_send"] == samples * 16 * 32
    assert sends["counts_equal"] and sends["elements_equal"]


def _verify(cfg, **kw):
    from pipeline.verify.run import verify

    return verify(cfg, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_plan_verifies(results: Path, case: str) -> None:
    """Each case in seconds (the stage solves shared where the sub-mesh and microbatch
    are the same; about 10 s for a case alone on a loaded 2-core machine)."""
    cfg = _cfg(results, case)
    record = _verify(cfg)
    _check(record, cfg, Path(record["plan"]))
    stages = [[st["stage"] for st in r["stages"]] for r in record["pipelined"]["ranks"]]
    # torch's loop placement: stage s on rank s mod p
    assert stages == ([[0, 2], [1, 3]] if case == "interleaved" else [[0], [1]])
    assert record["pipelined"]["replicas"] == (2 if case == "1f1b_dp" else 1)
    assert record["pipelined"]["replica_dims"] == (["dp"] if case == "1f1b_dp" else [])


@pytest.mark.parametrize("case", ["1f1b", "1f1b_dp"])
def test_a_perturbed_stage_fails(results: Path, case: str, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """One weight of the last stage moved by 1e-2 in the pipelined run (not in the
    reference): the check fails on that stage's gradients and the loss. The forked
    workers inherit the patched module."""
    import torch

    import pipeline.verify.pipelined_rank as pr

    original = pr.stage_modules

    def perturbed(model, stages, pp_rank, degree):
        out = original(model, stages, pp_rank, degree)
        with torch.no_grad():
            for _, mod in out:
                for name, p in mod.named_parameters():
                    if name == "layers.1.feed_forward.w2.weight":
                        p.add_(1e-2)
        return out

    monkeypatch.setattr(pr, "stage_modules", perturbed)
    record = _verify(_cfg(results, case), output=tmp_path / "verify.json")
    pp = record["pipelined"]
    assert not record["ok"] and not pp["ok"]
    assert pp["max_rel_diff"] > 1e-5
    assert pp["grads"]["layers.1.feed_forward.w2.weight"]["rel_diff"] > 1e-5
    assert pp["loss"]["rel_diff"] > 0
    assert json.loads((tmp_path / "verify.json").read_text())["ok"] is False


def _cli(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.verify", *args], cwd=tmp,
                          capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                               "HOME": str(tmp), "PIPELINE_PROGRESS": "0"})


def test_interleaved_with_too_few_layers_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = _cli(tmp_path, *TINY, "mesh=2", "mesh_names=[pp]",
                "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2",
                f"results_dir={out}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "2 x 2 virtual stages" in lines[0], lines
    assert "model.n_layers=2" in lines[0] and "allowed" in lines[0]
    assert not out.exists()


def test_an_edited_pipeline_section_is_refused(results: Path, tmp_path: Path) -> None:
    """The plan's stage modules edited (the embedding moved to the last stage): one line
    naming the entry, exit 2, no verify.json."""
    record_plan = Path(_verify(_cfg(results, "gpipe"))["plan"])
    doc = json.loads(record_plan.read_text())
    doc["pipeline"]["stages"][0]["modules"].remove("tok_embeddings")
    doc["pipeline"]["stages"][1]["modules"].append("tok_embeddings")
    edited = tmp_path / "plan.json"
    edited.write_text(json.dumps(doc))
    fresh = tmp_path / "results"  # checked before any stage writes there
    proc = _cli(tmp_path, *TINY, *CASES["gpipe"], f"results_dir={fresh}",
                "--plan", str(edited))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pipeline.stages[0].modules" in lines[0], lines
    assert "allowed" in lines[0]
    assert not (tmp_path / "verify.json").exists() and not fresh.exists()


def test_measure_of_a_pipelined_plan_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = _cli(tmp_path, *TINY, *CASES["gpipe"], f"results_dir={out}", "--measure", "3")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("--measure=3:"), lines
    assert not out.exists()
