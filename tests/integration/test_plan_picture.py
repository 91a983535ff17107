"""The picture of a plan (pipeline/stages/report/picture.py): its drawing model against the run's
own tables (the layer's redistributions are exactly the rows of redistributions.parquet
whose consumer is in the layer; placements as in solution.parquet and plan.json; totals
as in run.json), the PNG and SVG files, the report step's hook and the CLI."""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.core.artifacts import PLAN_PICTURE, PLAN_SVG, SENTINELS
from pipeline.stages.report import picture as plan_picture

TOY_2X4 = ("mesh=2x4", "lazy_costs=true")


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_placements_per_mesh_dim_and_bytes_by_hand() -> None:
    assert plan_picture.per_dim("S(0)RS(1)", ["dp", "cp", "tp"]) == "dp S(0) | cp R | tp S(1)"
    assert plan_picture.per_dim("P(avg)SS(0,2)", ["dp", "tp"]) == "dp P(avg) | tp SS(0,2)"
    assert plan_picture.placement_tokens("(S(0)S(1)|-|RR)") == ["S(0)", "S(1)"]
    assert plan_picture.placement_tokens("MP(0,4x2)P") == ["MP(0,4x2)", "P"]
    assert plan_picture.human_bytes(512) == "512 B"
    assert plan_picture.human_bytes(1536) == "1.5 KiB"
    assert plan_picture.human_bytes(8 * 2**20) == "8.0 MiB"


@pytest.mark.toy_runs(TOY_2X4)
def test_drawing_model_is_the_runs_tables(toy_results) -> None:
    run = toy_results.run(*TOY_2X4)
    solve = Path(run.dirs.solve)
    pic = plan_picture.build_picture(solve)
    assert pic.layer == "layers.0"
    assert pic.layer_count == 2  # the toy model has 2 layers
    assert pic.mesh_names == ("dp", "tp") and pic.mesh_shape == (2, 4)
    solution = {r["node"]: r for r in run.plan}
    by_name = {r["name"]: r for r in run.plan}
    layer_nodes = {n for n, r in solution.items() if r["layer"] == "layers.0"}
    # the layer's redistributions are exactly the table's rows into the layer's nodes
    rows = [r for r in pq.read_table(solve / "redistributions.parquet").to_pylist()
            if r["consumer"] in layer_nodes]
    assert rows  # the toy plan on 2x4 moves tensors inside the layer
    want = Counter((r["consumer_name"], r["src_placement"], r["dst_placement"],
                    tuple(r["collectives"]), r["bytes"], r["comm_us"]) for r in rows)
    got = Counter((x.consumer, x.src, x.dst, x.collectives, x.bytes, x.us)
                  for x in pic.layer_redistributions())
    assert got == want
    # each step's output is its node's chosen placement; a step holds nodes of one phase
    for step in (*pic.layer_forward, *pic.layer_backward):
        assert {by_name[n]["phase"] for n in step.nodes} == {step.phase}
        assert all(by_name[n]["layer"] == "layers.0" for n in step.nodes)
        if step.output is not None:
            assert step.output.placement == by_name[step.output.name]["output_placement"]
    # the weights drawn in the layer's forward are the layer's parameters, each in its
    # stored placement as plan.json gives it
    plan = json.loads((solve / "plan.json").read_text())
    stored = {p["fqn"]: p["placement"] for p in plan["parameters"]}
    drawn = {w.name: w.placement for s in pic.layer_forward for w in s.weights}
    assert drawn == {f: p for f, p in stored.items() if f.startswith("layers.0.")}
    assert len(drawn) == 9  # 2 norms, wq, wk, wv, wo, w1, w2, w3
    # the attention and MLP chain, in forward order
    labels = [s.label for s in pic.layer_forward]
    for a, b in [("attention_norm", "attention.wq"), ("attention.wq", "attention"),
                 ("attention", "attention.wo"), ("attention.wo", "ffn_norm"),
                 ("ffn_norm", "feed_forward.w1"), ("feed_forward.w1", "feed_forward.w2")]:
        assert labels.index(a) < labels.index(b), labels
    assert "residual" in labels
    assert any(s.op.startswith("_scaled_dot_product") for s in pic.layer_forward)
    # the embedding above the layer, the head and the loss below it
    assert [s.op for s in pic.pre_forward][0] == "embedding"
    assert "output" in [s.label for s in pic.post_forward]
    assert any(s.label == "loss" for s in pic.post_forward)
    # the side panel's totals are the run record's
    assert pic.totals == {k: {"count": float(v["count"]), "bytes": float(v["bytes"]),
                              "us": float(v["us"])}
                          for k, v in run.record["collectives"].items()}
    # the layer's totals count each collective of its rows once per run
    counts = Counter(c for r in rows for c in r["collectives"] for _ in range(r["times"]))
    assert {k: v["count"] for k, v in pic.layer_totals.items()} == dict(counts)
    us = sum(r["comm_us"] * r["times"] for r in rows if r["collectives"])
    assert sum(v["us"] for v in pic.layer_totals.values()) == pytest.approx(us)


@pytest.mark.toy_runs(TOY_2X4)
def test_picture_files_and_the_report_hook(toy_results, tmp_path: Path) -> None:
    from pipeline.stages.report.stage import run_report

    dirs = toy_results.copy_run(tmp_path / "results", *TOY_2X4)
    solve = Path(dirs.solve)
    for a in (PLAN_PICTURE, PLAN_SVG):
        a.path(solve).unlink(missing_ok=True)
    run_report(tmp_path / "results")  # the report step draws the missing picture
    png, svg = PLAN_PICTURE.path(solve), PLAN_SVG.path(solve)
    width, height = png_size(png)
    assert 1500 <= width <= 4000 and 800 <= height <= 6000, (width, height)
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "</svg>" in text
    # a current picture is not drawn again; one older than its run record is
    assert plan_picture.draw_plan_pictures(tmp_path / "results") == []
    record = solve / SENTINELS["solve"]
    old = record.stat().st_mtime - 10
    os.utime(png, (old, old))
    assert plan_picture.draw_plan_pictures(tmp_path / "results") == [solve]
    assert png.stat().st_mtime >= record.stat().st_mtime


def test_cli_refuses_a_directory_without_a_run(tmp_path: Path, capsys) -> None:
    assert plan_picture.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"solve_dir={tmp_path}: allowed a solve directory holding run.json")
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
