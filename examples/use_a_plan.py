"""Use a plan: parallelize your model as planned and train it (docs/plan.md, "Use a plan").

    python examples/use_a_plan.py results/runs/.../plan.json   # gloo, CPU, a process per device
    torchrun --nproc-per-node 8 examples/use_a_plan.py PLAN --cuda  # the same on GPUs

``model`` must be the module the plan was traced from: the same parameter and buffer
names, shapes and dtypes (``plans.load(..., model=model)`` checks the model hash), with
``forward(*inputs)`` returning the loss of the traced step. Here it is the built-in LLaMA
of the plan's model config (``model=toy|llama1b|...``), with random weights.
"""

from __future__ import annotations

import os
import sys


def train(rank: int, world: int, plan_path: str, store: str, device: str = "cpu",
          steps: int = 2) -> float:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline import plan as plans
    from pipeline.apply import parallelize
    from pipeline.dtensor.cpu_kernels import cpu_kernels
    from pipeline.models.llama import ModelConfig
    from pipeline.models.llama_decoder import Transformer

    dist.init_process_group("gloo" if device == "cpu" else "nccl",
                            init_method=f"file://{store}", rank=rank, world_size=world)
    plan = plans.load(plan_path)
    config = plan.model_config
    torch.manual_seed(0)  # the same weights on every rank
    with torch.device(device):
        model = Transformer(ModelConfig(**{k: config[k] for k in ModelConfig.__dataclass_fields__
                                           if k in config}))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.ndim > 1 else torch.nn.init.ones_(p)
    plans.load(plan_path, model=model)  # refuses another model
    mesh = init_device_mesh(device, plan.mesh_shape, mesh_dim_names=plan.mesh_names)
    report = parallelize(model, plan, mesh)  # FSDP2 / tensor parallel / fallback, in place
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b, t = config["batch_size"], config["seq_len"]
    loss = None
    with cpu_kernels():  # CPU kernels of the fused attention op (not needed on GPUs)
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)  # the same global batch on every rank
            tokens = torch.randint(0, config["vocab_size"], (b, t + 1), generator=gen)
            loss = model(tokens[:, :-1].to(device), tokens[:, 1:].to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    value = float(loss.full_tensor())
    if rank == 0:
        print(f"loss {value:.4f}; FSDP2 units {list(report.units)}; fallback {report.fallback}")
    dist.destroy_process_group()
    return value


def main(argv: list[str]) -> None:
    import math
    import tempfile

    import torch.multiprocessing as mp

    from pipeline import plan as plans

    plan_path = argv[0]
    if "--cuda" in argv:  # under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        train(rank, world, plan_path, os.environ.get("STORE", "/tmp/use_a_plan_store"), "cuda")
        return
    world = math.prod(plans.load(plan_path).mesh_shape)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(train, args=(world, plan_path, os.path.join(tmp, "store")),
                           nprocs=world, start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1:])
