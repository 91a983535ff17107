"""The pipelining model against torch: two gloo processes run each schedule with
torch.distributed.pipelining over FSDP2-wrapped stages. The forwards and backwards each
rank runs (``forward_one_chunk`` / ``backward_one_chunk`` of its stages, in the order they
run) are :func:`pipeline.costmodel.schedules.rank_orders`', and every all-gather a stage's
``FSDPParamGroup.unshard`` issues in one step (the second, after the shape inference of
the first) is counted per stage against
:func:`pipeline.costmodel.pipelining.fsdp_state`."""

from __future__ import annotations

import collections

import pytest

#: (schedule, reshard_after_forward, microbatches, virtual stages): each schedule with and
#: without resharding after forward; interleaved with v = 2 and with v = 4 (where the
#: schedule's own UNSHARD / RESHARD, 3 stages at most, re-gathers a stage).
CASES = [("gpipe", True, 4, 1), ("gpipe", False, 4, 1), ("1f1b", True, 3, 1),
         ("1f1b", False, 3, 1), ("interleaved_1f1b", False, 2, 2),
         ("interleaved_1f1b", True, 2, 2), ("interleaved_1f1b", False, 2, 4),
         ("interleaved_1f1b", True, 2, 4)]
WORLD = 2


def _worker(rank: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
    from torch.distributed.pipelining.stage import _PipelineStageBase

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("pp", "dp"))
    counts: collections.Counter = collections.Counter()
    stage_of: dict[int, int] = {}
    unshard = FSDPParamGroup.unshard

    def counting(self, async_op=False):  # an all-gather is issued only from sharded
        if not self.is_unsharded and self._all_gather_result is None:
            counts[stage_of[id(self)]] += 1
        return unshard(self, async_op)

    FSDPParamGroup.unshard = counting
    ran: list[tuple[str, int, int]] = []
    forward, backward = _PipelineStageBase.forward_one_chunk, _PipelineStageBase.backward_one_chunk

    def forward_chunk(self, chunk, *args, **kwargs):
        ran.append(("F", self.stage_index, chunk))
        return forward(self, chunk, *args, **kwargs)

    def backward_chunk(self, chunk, *args, **kwargs):
        ran.append(("B", self.stage_index, chunk))
        return backward(self, chunk, *args, **kwargs)

    _PipelineStageBase.forward_one_chunk = forward_chunk
    _PipelineStageBase.backward_one_chunk = backward_chunk
    results = []
    for schedule, raf, m, v in CASES:
        torch.manual_seed(0)
        stages = []
        for s in (rank + k * WORLD for k in range(v)):
            mod = nn.Sequential(nn.Linear(8, 8))
            fully_shard(mod, mesh=mesh["dp"], reshard_after_forward=raf)
            for group in fully_shard.state(mod)._fsdp_param_groups:
                stage_of[id(group)] = s
            stages.append(PipelineStage(mod, s, WORLD * v, torch.device("cpu"),
                                        group=mesh.get_group("pp")))

        def loss(out, target):
            return ((out - target) ** 2).mean()

        if schedule == "interleaved_1f1b":
            sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss)
        else:
            cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            sched = cls(stages[0], n_microbatches=m, loss_fn=loss)
        x, y = torch.randn(2 * m, 8), torch.randn(2 * m, 8)
        for _ in range(2):
            counts.clear()
            ran.clear()
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=y)
        results.append((list(ran), dict(counts)))
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_gathers_under_torch_pipelining_match_the_model(tmp_path):
    pytest.importorskip("torch.distributed.pipelining")
    import torch
    import torch.multiprocessing as mp

    from pipeline.costmodel.pipelining import fsdp_state
    from pipeline.costmodel.schedules import rank_orders

    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path / "counts")),
                       nprocs=WORLD, start_method="spawn", join=True)
    measured = [torch.load(tmp_path / f"counts.{r}") for r in range(WORLD)]
    for i, (schedule, raf, m, v) in enumerate(CASES):
        orders = rank_orders(schedule, WORLD, m, v)
        for r in range(WORLD):
            order, gathers = measured[r][i]
            assert order == [(op.kind, op.stage, op.microbatch) for op in orders[r]]
            model = fsdp_state(orders[r], raf, schedule == "interleaved_1f1b")[0]
            assert gathers == model, (schedule, raf, m, v, r)
