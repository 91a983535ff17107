"""Checks and resolution of pipeline parallelism (``pipeline.*``) and gradient
accumulation (``model.microbatches``), torch-free (docs/pipelining.md).

The pipeline degree ``p`` is the size of the mesh dim named ``pp`` (:data:`PP_DIM`),
which must be the outermost (first), as torchtitan builds its mesh ``[pp, dp_replicate,
dp_shard, cp, tp]`` (``torchtitan/distributed/parallel_dims.py``): the ranks of one stage
are then a contiguous block, and the sub-mesh of the other dims is the stage's mesh.
Without a ``pp`` dim (or with one of size 1) there is no pipeline.

The *local batch* is the samples one pipeline runs per step: ``model.batch_size`` (llama,
hf; a custom model's first input's dim 0) over the data-parallel degree, the product of
the mesh dims other than ``pp`` that shard the batch dim under ``constraints.inputs``
(the default ``S(0)`` on the first mesh dim means, with ``pp`` first, the first dim after
it: a pipeline never splits the batch over its stages). ``model.microbatches`` (gradient
accumulation) and ``pipeline.microbatches`` both split it:
``local batch = model.microbatches x pipeline.microbatches x microbatch size``.

:func:`resolve_pipeline` refuses, in one line each (key, value, what is allowed): a ``pp``
dim that is not the first, more stages (``p x virtual_stages``) than layers, microbatches
that do not divide the local batch, fewer microbatches than stages for 1F1B (torch's
``Schedule1F1B`` refuses them; ``ScheduleInterleaved1F1B`` also needs a multiple of its
rounds), virtual stages that do not divide the layers per rank, an explicit split that is
not increasing or does not cover the layers, an unknown schedule. The degree is a mesh
dim's size, so it divides the world size by construction.
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import ListConfig

from pipeline import models as model_families
from pipeline.config.overrides import override_value, printable
from pipeline.config.schema import ConfigError
from pipeline.core.placement_text import tokenize
from pipeline.costmodel.schedules import SCHEDULES, check_schedule

__all__ = ["PP_DIM", "balanced_split", "data_parallel_dims", "local_batch", "resolve_pipeline"]

#: The name of the pipeline mesh dim.
PP_DIM = "pp"


def _shown(value: Any) -> str:
    return printable(override_value(value, quote="never"))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def balanced_split(n_layers: int, stages: int) -> list[int]:
    """Boundaries ``[0, ..., n_layers]`` of ``stages`` contiguous stages whose sizes differ
    by at most one, the larger first: 10 layers in 4 stages -> ``[0, 3, 6, 8, 10]``."""
    q, r = divmod(int(n_layers), int(stages))
    out = [0]
    for s in range(stages):
        out.append(out[-1] + q + (1 if s < r else 0))
    return out


def data_parallel_dims(inputs: str | None, names: list[str]) -> list[int]:
    """The mesh dims other than ``pp`` that shard the batch (dim 0 of the inputs) under
    ``constraints.inputs`` (``None``: the first mesh dim that is not ``pp``)."""
    if inputs is None:
        free = [i for i, n in enumerate(names) if n != PP_DIM]
        return free[:1]
    return [i for i, p in enumerate(tokenize(inputs, len(names)))
            if names[i] != PP_DIM and p.is_shard() and int(p.dim) == 0]


def _batch(model: Any) -> tuple[int | None, str]:
    family = model_families.family_of(model)
    if family in ("llama", "hf"):
        return int(model.batch_size), "model.batch_size"
    inputs = model.get("inputs") or []
    if inputs and len(inputs[0].shape) > 0:
        return int(inputs[0].shape[0]), "model.inputs.0.shape.0"
    return None, "model.inputs"


def local_batch(out: Any, mesh: list[int], names: list[str]) -> tuple[int, str]:
    """``(samples per pipeline per step, how it was found)`` (module docstring).

    Raises:
        ConfigError: when the batch is unknown or the data-parallel dims do not divide it.
    """
    batch, key = _batch(out.model)
    if batch is None:
        raise ConfigError(f"{key}: no inputs, so no batch to split into microbatches; "
                          "allowed model.microbatches=1 and no pp mesh dim")
    dims = data_parallel_dims(out.constraints.inputs, names)
    dp = math.prod(mesh[d] for d in dims)
    over = ", ".join(f"{names[d]}={mesh[d]}" for d in dims) or "none"
    if batch % dp:
        raise ConfigError(f"{key}={batch}: the data-parallel mesh dims ({over}) do not divide "
                          f"it, so a pipeline's local batch is not whole; allowed a multiple "
                          f"of {dp} with microbatches")
    return batch // dp, f"{key}={batch} over the data-parallel dims ({over})"


def _plain(value: Any) -> Any:
    """A ``ListConfig`` as a list (OmegaConf's nodes are not lists)."""
    return list(value) if isinstance(value, ListConfig) else value


def _check_types(pl: Any, model_mb: Any) -> None:
    if pl.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule={_shown(pl.schedule)}: allowed "
                          f"{', '.join(SCHEDULES)}")
    if not (_is_int(pl.virtual_stages) and pl.virtual_stages >= 1):
        raise ConfigError(f"pipeline.virtual_stages={_shown(pl.virtual_stages)}: allowed an "
                          "integer >= 1")
    if pl.microbatches != "auto" and not (_is_int(pl.microbatches) and pl.microbatches >= 1):
        raise ConfigError(f"pipeline.microbatches={_shown(pl.microbatches)}: allowed an "
                          "integer >= 1 or auto")
    split = _plain(pl.split)
    if split != "auto" and not (isinstance(split, (list, tuple)) and split
                                and all(_is_int(b) for b in split)):
        raise ConfigError(f"pipeline.split={_shown(split)}: allowed auto or a list of layer "
                          "boundaries [0, b1, ..., n_layers]")
    if not (_is_int(model_mb) and model_mb >= 1):
        raise ConfigError(f"model.microbatches={_shown(model_mb)}: allowed an integer >= 1")


def _no_pipeline(pl: Any) -> None:
    """Without a pipeline the pipeline keys keep their defaults."""
    why = f"no mesh dim named {PP_DIM} of size > 1, so no pipeline"
    if pl.microbatches not in ("auto", 1):
        raise ConfigError(f"pipeline.microbatches={_shown(pl.microbatches)}: {why}; allowed "
                          "auto or 1 (model.microbatches for gradient accumulation)")
    if pl.virtual_stages != 1:
        raise ConfigError(f"pipeline.virtual_stages={_shown(pl.virtual_stages)}: {why}; "
                          "allowed 1")
    if _plain(pl.split) != "auto":
        raise ConfigError(f"pipeline.split={_shown(_plain(pl.split))}: {why}; allowed auto")


def _stages(pl: Any, p: int, n_layers: int, mesh_text: str) -> list[int]:
    """The checked split of ``n_layers`` into ``p x virtual_stages`` stages."""
    v = int(pl.virtual_stages)
    if pl.schedule == "interleaved_1f1b" and v < 2:
        raise ConfigError(f"pipeline.virtual_stages={v}: interleaved_1f1b runs at least 2 "
                          "stages per pp rank; allowed an integer >= 2 (or "
                          "pipeline.schedule=1f1b)")
    if pl.schedule != "interleaved_1f1b" and v != 1:
        raise ConfigError(f"pipeline.virtual_stages={v}: pipeline.schedule={pl.schedule} "
                          "runs one stage per pp rank; allowed 1 (or "
                          "pipeline.schedule=interleaved_1f1b)")
    stages = p * v
    if stages > n_layers:
        raise ConfigError(f"mesh={mesh_text} ({PP_DIM}={p}): {p} x {v} virtual stages = "
                          f"{stages} stages, more than the model.n_layers={n_layers} "
                          f"layers; allowed at most {n_layers} stages")
    if _plain(pl.split) == "auto":
        if v > 1 and n_layers % p == 0 and (n_layers // p) % v:
            raise ConfigError(f"pipeline.virtual_stages={v}: must divide the "
                              f"{n_layers // p} layers per pp rank (model.n_layers={n_layers} "
                              f"/ {PP_DIM}={p}); allowed a divisor of {n_layers // p}")
        return balanced_split(n_layers, stages)
    split = [int(b) for b in pl.split]
    shown = f"pipeline.split={_shown(split)}"
    if len(split) != stages + 1:
        raise ConfigError(f"{shown}: {len(split)} boundaries; allowed {stages + 1} "
                          f"([0, ..., {n_layers}], one stage per {PP_DIM} rank x virtual "
                          "stage)")
    if any(b <= a for a, b in zip(split, split[1:])):
        raise ConfigError(f"{shown}: not increasing; allowed strictly increasing layer "
                          "boundaries (every stage holds at least one layer)")
    if split[0] != 0 or split[-1] != n_layers:
        raise ConfigError(f"{shown}: does not cover the layers; allowed boundaries from 0 "
                          f"to model.n_layers={n_layers}")
    return split


def resolve_pipeline(out: Any, mesh: list[int], names: list[str]) -> tuple[int, list[int] | str]:
    """Check ``pipeline.*`` and ``model.microbatches`` against the mesh and the model.

    Returns:
        ``(pipeline microbatches, split)``: with a pipeline, the microbatch count
        (``auto``: the local batch over ``model.microbatches``, one sample each) and the
        boundaries; without, ``(1, "auto")``.

    Raises:
        ConfigError: one line (module docstring).
    """
    pl = out.pipeline
    model_mb = out.model.get("microbatches", 1)
    _check_types(pl, model_mb)
    if PP_DIM in names and names.index(PP_DIM) != 0:
        raise ConfigError(f"mesh_names={_shown(list(names))}: the pipeline dim {PP_DIM} must "
                          f"be the outermost; allowed {PP_DIM} first, e.g. "
                          f"[{','.join([PP_DIM] + [n for n in names if n != PP_DIM])}]")
    p = mesh[0] if names and names[0] == PP_DIM else 1
    if p == 1:
        _no_pipeline(pl)
        if model_mb > 1:
            _divides("model.microbatches", model_mb, *local_batch(out, mesh, names))
        return 1, "auto"
    if model_families.family_of(out.model) != "llama":
        raise ConfigError(f"mesh_names={_shown(list(names))}: pipeline stages split the "
                          "repeated layers, whose count only the llama family names "
                          f"(model.family={model_families.family_of(out.model)}); allowed "
                          f"no {PP_DIM} dim for this model")
    split = _stages(pl, p, int(out.model.n_layers), "x".join(str(d) for d in mesh))
    batch, how = local_batch(out, mesh, names)
    _divides("model.microbatches", model_mb, batch, how)
    per_step = batch // model_mb
    m = per_step if pl.microbatches == "auto" else int(pl.microbatches)
    if pl.microbatches != "auto":
        _divides("pipeline.microbatches", m, per_step,
                 how + (f", over model.microbatches={model_mb}" if model_mb > 1 else ""))
    shown = f"auto ({m})" if pl.microbatches == "auto" else str(m)
    if pl.schedule in ("1f1b", "interleaved_1f1b") and m < p:
        allowed = (f"an integer >= {p} dividing {per_step}" if per_step >= p else
                   f"a local batch of at least {p} samples (it is {per_step}: {how})")
        raise ConfigError(f"pipeline.microbatches={shown}: {pl.schedule} needs at least as "
                          f"many microbatches as pipeline stages ({PP_DIM}={p}); allowed "
                          f"{allowed}, or pipeline.schedule=gpipe")
    if pl.schedule == "interleaved_1f1b" and m % (m // p):
        raise ConfigError(f"pipeline.microbatches={shown}: interleaved_1f1b needs a multiple "
                          f"of its {m // p} rounds (microbatches // {PP_DIM}); allowed e.g. a "
                          f"multiple of {p}")
    check_schedule(pl.schedule, p, m, int(pl.virtual_stages))  # the rules above: passes
    return m, split


def _divides(key: str, value: int, batch: int, how: str) -> None:
    if batch % value:
        raise ConfigError(f"{key}={value}: must divide the local batch of {batch} samples "
                          f"({how}); allowed a divisor of {batch}")
