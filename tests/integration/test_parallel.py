"""Forked workers (pipeline/core/parallel.py) and the two phases that use them: the DTensor
strategies of distinct op signatures (topology) and the pairwise group factors (costs).
Parallel results must equal the serial ones exactly."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core.parallel import WorkerError, balanced_chunks, map_chunks, resolve_workers


def test_balanced_chunks_longest_first_by_hand() -> None:
    # weights 5,4,3,3,2,1 into 2: 5->A, 4->B, 3->B (4<5), 3->A (5<7), 2->B (7<8), 1->A
    # (8<9): A = {0,3,5} (9), B = {1,2,4} (9)
    assert balanced_chunks([5, 4, 3, 3, 2, 1], 2) == [[0, 3, 5], [1, 2, 4]]
    # ties go to the lower chunk, equal weights to the lower index first
    assert balanced_chunks([1, 1, 1], 2) == [[0, 2], [1]]
    # more parts than items: one chunk per item, empty ones dropped
    assert balanced_chunks([2.0, 1.0], 4) == [[0], [1]]
    assert balanced_chunks([], 3) == []


def test_resolve_workers() -> None:
    assert resolve_workers(0) == len(os.sched_getaffinity(0))
    assert resolve_workers(3) == 3
    with pytest.raises(ValueError, match="workers=-1"):
        resolve_workers(-1)


def test_map_chunks_runs_chunks_after_the_first_in_children_in_order() -> None:
    state = {"offset": 100}  # a closure over local state: nothing is pickled but results

    def work(chunk: list[int]) -> tuple[int, list[int]]:
        return os.getpid(), [x + state["offset"] for x in chunk]

    out = map_chunks(work, [[1, 2], [3], [4, 5, 6]])
    assert [r[1] for r in out] == [[101, 102], [103], [104, 105, 106]]
    pids = [r[0] for r in out]
    assert pids[0] == os.getpid() and len(set(pids)) == 3


def test_map_chunks_reraises_a_childs_exception_with_its_traceback() -> None:
    def work(chunk: int) -> int:
        if chunk == 2:
            raise KeyError(f"bad chunk {chunk}")
        return chunk

    with pytest.raises(KeyError, match="bad chunk 2") as info:
        map_chunks(work, [1, 2])
    assert "in worker 1 of 2" in "".join(getattr(info.value, "__notes__", []))


def test_map_chunks_names_a_child_that_died() -> None:
    def work(chunk: int) -> int:
        if chunk:
            os._exit(3)
        return chunk

    with pytest.raises(WorkerError, match="exited with code 3"):
        map_chunks(work, [0, 1])


# --------------------------------------------------------------------------- the phases


@pytest.fixture(scope="module")
def toy_graph() -> object:
    from omegaconf import OmegaConf

    from pipeline.config.compose import load_resolved
    from pipeline.stages.topology import load_nodes
    from pipeline.stages.trace.stage import trace_model

    cfg = load_resolved(["model=toy", "mesh=2x4x8"])
    table, _ = trace_model(OmegaConf.to_container(cfg.model, resolve=True), 64)
    return cfg, load_nodes(table)


def _topology(cfg: object, nodes: list, out: Path, workers: int) -> object:
    from pipeline.stages.topology import build_topology, device_mesh, read_topology, write_topology

    mesh, names = (2, 4, 8), ("dp", "cp", "tp")
    topo = build_topology(nodes, device_mesh(mesh, names), mesh, names,
                          {"fwd_bwd_consistency": True}, True, workers=workers)
    write_topology(topo, out, {"stage": "topology"})
    return read_topology(out)


def test_parallel_topology_and_factors_equal_serial(toy_graph: object, tmp_path: Path) -> None:
    from pipeline.config.readers import param_memory_config
    from pipeline.stages.costs.stage import build_mrf, memory_config

    cfg, nodes = toy_graph
    serial = _topology(cfg, nodes, tmp_path / "w1", 1)
    parallel = _topology(cfg, nodes, tmp_path / "w2", 2)
    for name in ("nodes.parquet", "edges.parquet", "strategies.parquet"):
        assert pq.read_table(tmp_path / "w1" / name).equals(pq.read_table(tmp_path / "w2" / name))
    assert parallel.summary["counts"] == serial.summary["counts"]

    def factors(workers: int) -> tuple[list, object]:
        costs = build_mrf(serial, cfg.hardware, lazy=True,
                          param_memory=param_memory_config(cfg), **memory_config(cfg),
                          fuse_pointwise=True)
        provider = costs.factor_provider
        chunks, work = provider.work_chunks(workers)
        provider.build_parallel(workers, min_work=0)  # the toy is below the threshold
        return [provider.factor(e) for e in range(costs.mrf.num_edges)], (chunks, work)

    one, _ = factors(1)
    two, (chunks, work) = factors(2)
    assert len(chunks) == 2 and work > 0
    assert sorted(ge for c in chunks for ge in c) == list(range(len(one)))
    for a, b in zip(one, two, strict=True):
        assert np.array_equal(a.row_cls, b.row_cls) and np.array_equal(a.col_cls, b.col_cls)
        assert a.table.tobytes() == b.table.tobytes()  # bit for bit


def test_prefetch_fills_the_memo_with_the_serial_strategies(toy_graph: object) -> None:
    from pipeline.dtensor.placements import format_placements, format_strategy_output
    from pipeline.stages.topology import device_mesh
    from pipeline.stages.topology.strategies import StrategyEnumerator

    _, nodes = toy_graph
    mesh = device_mesh((2, 4, 8), ("dp", "cp", "tp"))
    forked = StrategyEnumerator(mesh, (2, 4, 8))
    forked.prefetch(nodes, 2)
    assert len(forked.cache) >= 32  # above the threshold: the workers ran
    serial = StrategyEnumerator(mesh, (2, 4, 8))
    for n in nodes:
        if n.kind == "call_function" and n.target != "getitem":
            serial.op_strategies(n, [nodes[r].outputs[0] for r in n.refs])
    assert forked.cache.keys() == serial.cache.keys()
    assert forked.rejections() == serial.rejections()  # the workers' counts came back
    assert forked.rejections()  # the toy has rejected candidates (unbind, nll_loss)

    def text(strategies: object) -> list:  # _MaskPartial's == compares its mask buffer's
        return [(format_strategy_output(o), [format_placements(p) for p in ins])  # identity
                for o, ins in zip(strategies.outputs, strategies.inputs, strict=True)]

    for key, strategies in serial.cache.items():
        assert text(forked.cache[key]) == text(strategies)
        assert forked.cache[key].fallback == strategies.fallback


def test_a_mask_partial_survives_the_way_back_from_a_worker() -> None:
    # pickling a _MaskPartial keeps only its reduce op (its C++ base pickles that alone);
    # the prefetch sends it as its fields and restores it, shared buffers shared again
    import pickle

    import torch
    from torch.distributed.tensor.placement_types import MaskBuffer, Replicate, _MaskPartial

    from pipeline.stages.topology.candidates import StrategyList
    from pipeline.stages.topology.portable import portable, restored

    buf = MaskBuffer()
    mp = _MaskPartial("sum", buf, torch.Size([1024, 256]), 0)
    lost = pickle.loads(pickle.dumps(mp))
    assert lost.offset_shape is None or not hasattr(lost, "mask_buffer")  # why it is needed
    other = _MaskPartial("max", MaskBuffer(), torch.Size([8, 4]), 1)
    sl = StrategyList(outputs=((Replicate(), mp), (other, Replicate())),
                      inputs=(((Replicate(), mp),), ((Replicate(), other),)))
    back = restored(pickle.loads(pickle.dumps(portable(sl, {}))), {})
    (o0, o1), (i0, i1) = back.outputs, back.inputs
    assert o0[1] == i0[0][1] and o0[1] is not mp  # one buffer for both, a new one
    assert o1[0] == i1[0][1]
    assert (o0[1].reduce_op, tuple(o0[1].offset_shape), o0[1].offset_dim) == ("sum", (1024, 256), 0)
    assert (o1[0].reduce_op, tuple(o1[0].offset_shape), o1[0].offset_dim) == ("max", (8, 4), 1)
    assert o1[0] != o0[1] and hash(o1[0]) != hash(o0[1])
    assert back.fallback is False and o0[0] == Replicate()


PICTURE_RUNS = (("mesh=8", "lazy_costs=true"), ("mesh=2x4", "lazy_costs=true"))


@pytest.mark.toy_runs(*PICTURE_RUNS)
def test_plan_pictures_drawn_in_two_processes(toy_results: object, tmp_path: Path) -> None:
    from pipeline.core.artifacts import PLAN_PICTURE, PLAN_SVG
    from pipeline.stages.report.picture import draw_plan_pictures, is_current

    solve_dirs = [Path(toy_results.copy_run(tmp_path / "results", *r).solve)
                  for r in PICTURE_RUNS]
    for d in solve_dirs:
        for a in (PLAN_PICTURE, PLAN_SVG):
            a.path(d).unlink(missing_ok=True)
    drawn = draw_plan_pictures(tmp_path / "results", solve_dirs, workers=2)
    assert drawn == solve_dirs and all(is_current(d) for d in solve_dirs)
    assert PLAN_PICTURE.path(solve_dirs[1]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert draw_plan_pictures(tmp_path / "results", solve_dirs, workers=2) == []  # current
