"""What the processes of a verify run execute: the model with real weights, the planned
step on a ``gloo`` process group, and rank 0's single-process reference step.

:mod:`pipeline.verify.run` checks the inputs, runs the stages, forks one process per
mesh device with :func:`worker` and writes ``verify.json`` from what the processes
return. Every process builds the same model with small random weights and the same
inputs from a fixed seed (:func:`build_real_model`, :func:`real_inputs`: the built-in
LLaMA family, or an ``hf`` architecture built on CPU with transformers' ``from_config``
and the attention and experts implementation the trace used), and runs the plan
(:func:`pipeline.apply.run_step`: every node's output placement checked against the
plan, collectives counted); rank 0 also runs the reference step (eager forward, loss,
``backward()`` on the unsharded model). Both compute in float32.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.core.errors import PlanError
from pipeline.plan.format import model_hash_of_module

#: Seconds a process waits in a collective before giving up (a peer failed).
COLLECTIVE_TIMEOUT_S = 180


class VerifyUsageError(PlanError):
    """A bad verify flag or input (one line)."""


# --------------------------------------------------------------------------- model


def build_real_model(model_cfg: dict[str, Any], seed: int, param_dtype: str = "float32"
                     ) -> Any:
    """The model of ``model_cfg`` on CPU with small random weights from ``seed``, computing
    in ``param_dtype``; ``model(*inputs)`` returns the loss of the traced training step.

    Matrices ``[.., fan_in]`` are drawn from N(0, 1/fan_in), vectors (norm weights,
    biases) from 1 + N(0, 0.1^2), in ``named_parameters`` order (a tied tensor once,
    under its first name, as the trace records it) from one ``torch.Generator``, so every
    process builds the same weights. Buffers are the model's own (RoPE tables).

    ``hf`` family: the architecture of :func:`pipeline.models.hf.build`, built with
    transformers' ``from_config`` on CPU (no hub) with the attention and experts
    implementation the trace used, parameters stored in float32; its ``forward`` is
    replaced (on the instance) by the family's step (forward, then the cross-entropy of
    the logits), which is what the trace captured (the cast to ``param_dtype`` is the
    identity here: the step is verified in float32).
    """
    import torch

    check_model_family(model_cfg)
    if family_of(model_cfg) == "hf":
        model = _build_real_hf(model_cfg)
    else:
        from pipeline.models.llama import ModelConfig
        from pipeline.models.llama_decoder import Transformer

        fields = {k: model_cfg[k] for k in ModelConfig.__dataclass_fields__ if k in model_cfg}
        fields["param_dtype"] = param_dtype
        with torch.device("cpu"):
            model = Transformer(ModelConfig(**fields))
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    return model


def _build_real_hf(model_cfg: dict[str, Any]) -> Any:
    """The ``hf`` architecture of ``model_cfg`` on CPU, forward replaced by the step."""
    import functools

    import torch
    import transformers

    from pipeline.models import ModelError, hf

    try:
        config = hf.hf_config(model_cfg)
    except ValueError as err:
        raise ModelError(str(err)) from None
    auto = getattr(transformers, hf.TASKS[model_cfg["task"]])
    model_class = auto._model_mapping[type(config)]
    attn = model_cfg["attn_implementation"]
    if attn == "fused":
        hf.register_attention()
        attn = hf.ATTENTION_NAME
    kwargs: dict[str, Any] = {"attn_implementation": attn}
    if model_class._can_set_experts_implementation():
        kwargs["experts_implementation"] = model_cfg["experts_implementation"]
    with torch.device("cpu"):
        model = auto.from_config(config, dtype=torch.float32, **kwargs)
    model.train()
    model.forward = functools.partial(hf.step, model.forward, task=model_cfg["task"])
    return model


def family_of(model_cfg: dict[str, Any]) -> str:
    """``model.family`` of ``model_cfg`` (``llama`` when absent)."""
    from pipeline.models import family_of as _family_of

    return _family_of(model_cfg)


#: Model families verify builds real weights for (``custom`` builders give no recipe
#: for real weights on CPU).
VERIFY_FAMILIES: tuple[str, ...] = ("llama", "hf")


def check_model_family(model_cfg: dict[str, Any]) -> None:
    """Fail (one line) for a model config verify cannot build with real weights: a
    family other than :data:`VERIFY_FAMILIES`, or a built-in LLaMA config with keys
    ``ModelConfig`` does not know.

    Raises:
        VerifyUsageError: the family or a key is not one verify builds.
    """
    from pipeline.models.llama import ModelConfig

    family = family_of(model_cfg)
    if family not in VERIFY_FAMILIES:
        raise VerifyUsageError(
            f"model.family={family}: verify builds real weights for the "
            + ", ".join(VERIFY_FAMILIES) + " families only (model=toy|llama1b|llama8b|"
            "llama70b|hf/<preset>)")
    if family != "llama":
        return
    extra = sorted(set(model_cfg) - set(ModelConfig.__dataclass_fields__) - {"family"})
    if extra:
        raise VerifyUsageError(
            f"model.{extra[0]}={model_cfg[extra[0]]!r}: verify builds real weights for the "
            "built-in llama family only (model=toy|llama1b|llama8b|llama70b)")


def check_deterministic(nodes: Sequence[Any]) -> None:
    """Fail (one line) when the traced step draws random numbers (dropout with p > 0):
    the planned and the single-process step would draw different masks.

    Raises:
        VerifyUsageError: names the first such node and its probability.
    """
    for n in nodes:
        if n.kind == "call_function" and n.target == "aten.native_dropout.default":
            p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p")
            train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
            if train and isinstance(p, (int, float)) and p > 0:
                raise VerifyUsageError(
                    f"node {n.name} ({n.target}, {n.module_path or 'model'}): dropout "
                    f"p={p} draws random masks the planned and reference steps cannot "
                    "share; allowed: dropout 0 (e.g. model.config.resid_pdrop=0 "
                    "model.config.embd_pdrop=0 model.config.attn_pdrop=0)")


def real_inputs(model_cfg: dict[str, Any], seed: int) -> list[Any]:
    """The step's token inputs, uniform over the vocabulary, from ``seed + 1`` (the same
    on every process): token batch and labels ``[batch_size, seq_len]``; an ``hf``
    seq2seq model gets encoder tokens ``[batch_size, seq_len]``, then decoder tokens and
    labels ``[batch_size, decoder_seq_len]``."""
    import torch

    gen = torch.Generator().manual_seed(int(seed) + 1)
    b, t = int(model_cfg["batch_size"]), int(model_cfg["seq_len"])
    shapes = [(b, t), (b, t)]
    if family_of(model_cfg) == "hf":
        from pipeline.models import hf

        vocab = int(hf.hf_config(model_cfg).vocab_size)
        if model_cfg["task"] == "seq2seq":
            td = int(model_cfg.get("decoder_seq_len") or t)
            shapes = [(b, t), (b, td), (b, td)]
    else:
        vocab = int(model_cfg["vocab_size"])
    return [torch.randint(0, vocab, shape, generator=gen) for shape in shapes]


def model_hash_of_config(model_cfg: dict[str, Any]) -> str:
    """The model hash (:func:`pipeline.plan.format.model_hash_of_module`) of ``model_cfg``'s
    module, built on meta (no weights)."""
    if family_of(model_cfg) == "hf":
        from pipeline.models import build

        return model_hash_of_module(build(model_cfg).module)
    from pipeline.models.llama_decoder import build_model

    return model_hash_of_module(build_model(model_cfg))


def reference_step(model: Any, inputs: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
    """The unsharded training step in one process: ``loss = model(*inputs)``,
    ``loss.backward()``; returns the loss and ``{fqn: grad}``."""
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return loss.detach(), grads


def difference(got: Any, ref: Any) -> dict[str, float]:
    """``{"abs_diff": max|a - b|, "rel_diff": max|a - b| / max|b|}`` (0 when equal)."""
    diff = float((got.double() - ref.double()).abs().max()) if got.numel() else 0.0
    scale = float(ref.double().abs().max()) if ref.numel() else 0.0
    rel = 0.0 if diff == 0.0 else (diff / scale if scale > 0 else math.inf)
    return {"abs_diff": diff, "rel_diff": rel}


# --------------------------------------------------------------------------- workers


def worker(rank: int, job: dict[str, Any]) -> None:
    """One process of the verify run (see the module docstring); writes
    ``rank<k>.json`` into ``job["out_dir"]``."""
    import torch
    import torch.distributed as dist

    from pipeline.dtensor.torch_compat import NOISY_LOGGERS

    torch.set_num_threads(1)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if dist.is_initialized():  # a fake process group inherited from the parent (fork)
        dist.destroy_process_group()
    out = Path(job["out_dir"]) / f"rank{rank}.json"
    dist.init_process_group("gloo", init_method=f"file://{job['store']}", rank=rank,
                            world_size=job["world"],
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        result = _run_rank(rank, job)
    except PlanError as err:
        result = {"error": str(err).splitlines()[0], "error_type": type(err).__name__}
    finally:
        dist.destroy_process_group()
    out.write_text(json.dumps(result, sort_keys=True))


def _run_rank(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline.apply import CollectiveCounter, resolve_target, run_step
    from pipeline.dtensor.cpu_kernels import cpu_kernels
    from pipeline.dtensor.placements import format_placements

    plan = job["plan"]
    mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.mesh_names)
    timings: dict[str, float] = {}
    ops = {resolve_target(n.target) for n in job["nodes"] if n.kind == "call_function"}
    with cpu_kernels(op for op in ops if op is not None):
        start = time.perf_counter()
        model = build_real_model(job["model_cfg"], job["seed"])
        inputs = real_inputs(job["model_cfg"], job["seed"])
        params = {n: p.detach() for n, p in model.named_parameters()}
        buffers = {n: b.detach() for n, b in model.named_buffers()}
        timings["build"] = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad(), CollectiveCounter(mesh) as counter:
            step = run_step(job["nodes"], plan, mesh, params=params, buffers=buffers,
                            inputs=inputs, compute_dtype=torch.float32, counter=counter)
        timings["planned_step"] = time.perf_counter() - start
        loss = step.loss.full_tensor()
        grads = {k: (v.full_tensor(), format_placements(v.placements))
                 for k, v in sorted(step.grads.items())}
        result: dict[str, Any] = {
            "rank": rank, "collectives": step.collectives, "op_collectives": step.op_collectives,
            "nodes_checked": step.nodes_checked, "redistributions": step.redistributions,
            "peak_local_bytes": step.peak_local_bytes}
        if rank == 0:
            start = time.perf_counter()
            ref_loss, ref_grads = reference_step(model, inputs)
            timings["reference_step"] = time.perf_counter() - start
            result["loss"] = {"value": float(loss), "reference": float(ref_loss),
                              **difference(loss, ref_loss)}
            result["grads"] = {}
            for fqn, ref in ref_grads.items():
                if fqn not in grads:
                    result["grads"][fqn] = {"missing": True}
                    continue
                full, placement = grads[fqn]
                result["grads"][fqn] = {"shape": list(ref.shape), "placement": placement,
                                        **difference(full, ref)}
    result["seconds"] = timings
    return result
