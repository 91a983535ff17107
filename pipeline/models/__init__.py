"""Model families: how the trace stage builds a module, its example inputs and its loss.

A *model family* (llama, hf, custom) is selected by ``model.family`` and owns one
structured-config schema, a cheap validation run on every resolve, an optional
*preflight* check run once before any stage writes (it may import heavy packages or run
the module on the meta device), and a builder:

=========  ==============================  ===========================================
family     schema                          builder
=========  ==============================  ===========================================
llama      ``llama.ModelConfig``           the built-in LLaMA-3 decoder (``model=toy``,
                                           ``llama1b``, ...); its forward returns the loss
hf         ``hf.HFModelConfig``            a Hugging Face transformers architecture from
                                           ``AutoConfig.for_model(model_type, **config)``
                                           and the task's auto class, on meta (``model=hf``,
                                           ``model=hf/<preset>``; needs the ``hf`` extra)
custom     ``custom.CustomModelConfig``    any ``nn.Module`` a Hydra ``_target_`` builds,
                                           with an input spec and a loss (``model=custom``)
=========  ==============================  ===========================================

:func:`build` returns a :class:`BuiltModel`: the module (on meta), the example inputs,
the training-step function the trace captures (``None``: the module's forward already
returns the scalar loss), the compute dtype parameters are cast to, and facts for the run
record. Everything after the trace is family-agnostic.

This module imports no family module at import time (the ``hf`` family imports
transformers only when a model is built or checked).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.core import schema_types

__all__ = [
    "FAMILIES",
    "OPEN_MAPPING_KEYS",
    "BuiltModel",
    "ModelError",
    "base_option",
    "build",
    "family_of",
    "field_type",
    "preflight",
    "schema_of",
    "trace_key",
    "validate",
]

#: Family name -> module implementing it (imported on first use).
FAMILIES: dict[str, str] = {
    "llama": "pipeline.models.llama",
    "hf": "pipeline.models.hf",
    "custom": "pipeline.models.custom",
}

#: Model keys that are free-form mappings (transformers config fields, builder kwargs):
#: an override of an entry not in the preset adds it (``++`` in Hydra's grammar).
OPEN_MAPPING_KEYS: tuple[str, ...] = ("model.config", "model.builder", "model.trace_env")


class ModelError(ValueError):
    """A model that cannot be built or traced as configured; ``str(err)`` is one line
    naming the key, the value and what is allowed (exit status 2, like a ConfigError)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


@dataclass
class BuiltModel:
    """A model ready for capture (see the module docstring).

    Attributes:
        module: the ``nn.Module`` on the meta device (parameters in float32).
        inputs: example inputs of the training step, meta tensors in graph order.
        step: ``step(*inputs) -> loss`` run in place of ``module.forward`` during the
            capture (it calls the original forward); ``None`` when the forward itself
            returns the loss.
        compute_dtype: parameters are cast to this dtype inside the step (FSDP2's
            ``MixedPrecisionPolicy.param_dtype``); ``None``: no cast.
        info: facts for the run record: ``family``, ``architecture`` (class name),
            ``width`` (hidden size when the family knows it), and family extras.
    """

    module: Any
    inputs: tuple
    step: Callable[..., Any] | None = None
    compute_dtype: Any = None
    info: dict[str, Any] = field(default_factory=dict)


def _family_module(family: str) -> Any:
    if family not in FAMILIES:
        raise ModelError(f"model.family={family}: allowed {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[family])


def family_of(model_cfg: Mapping[str, Any]) -> str:
    """``model.family`` of a model config (``llama`` when absent, as in old records).

    Raises:
        ModelError: for an unknown family.
    """
    family = model_cfg.get("family", "llama") if hasattr(model_cfg, "get") else "llama"
    if family not in FAMILIES:
        raise ModelError(f"model.family={family}: allowed {', '.join(FAMILIES)}")
    return str(family)


def schema_of(family: str) -> type:
    """The structured-config dataclass of ``family``."""
    return _family_module(family).SCHEMA


def base_option(family: str) -> str | None:
    """The ``conf/model/`` option holding the family's defaults (``hf``, ``custom``), or
    ``None`` for the default group option's family (llama)."""
    return {"llama": None, "hf": "hf", "custom": "custom"}[family]


def field_type(key: str) -> tuple[Any, bool] | None:
    """(type, optional) of a dotted ``model.*`` key in any family's schema, ``None`` when no
    family has it. ``model`` itself is ``(Any, False)``; inside an open mapping
    (:data:`OPEN_MAPPING_KEYS`) everything is ``(Any, True)``."""
    parts = key.split(".")
    if parts[0] != "model":
        return None
    if len(parts) == 1:
        return Any, False
    if any(key == k or key.startswith(k + ".") for k in OPEN_MAPPING_KEYS) and len(parts) > 2:
        return Any, True
    for family in FAMILIES:
        found = schema_types.field_type(schema_of(family), parts[1:])
        if found is not None:
            return found
    return None


def validate(model_cfg: Mapping[str, Any]) -> None:
    """Cheap checks of a model config (no heavy imports); raises :class:`ModelError`
    (a ``ValueError``) with a one-line message."""
    _family_module(family_of(model_cfg)).validate(model_cfg)


def preflight(model_cfg: Mapping[str, Any]) -> None:
    """The checks that need the family's packages or a forward on meta (unknown
    transformers model type or config field, a builder that is not importable or returns
    no ``nn.Module``, a forward without a tensor to take the loss of, an input spec
    the module refuses); run once before any stage writes. Raises :class:`ModelError`."""
    module = _family_module(family_of(model_cfg))
    module.validate(model_cfg)
    check = getattr(module, "preflight", None)
    if check is not None:
        check(model_cfg)


def build(model_cfg: Mapping[str, Any]) -> BuiltModel:
    """Build the model of ``model_cfg`` on the meta device (see :class:`BuiltModel`)."""
    module = _family_module(family_of(model_cfg))
    module.validate(model_cfg)
    return module.build(model_cfg)


def trace_key(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What the traced graph depends on outside the config: the torch version, and the
    family's own (the transformers version; a custom builder's source file hash).
    ``resolve()`` stores it as ``model.trace_env`` (every schema has the field; a value
    given is replaced), so it is part of the trace key: an upgrade or an edited builder
    gives a new trace directory, and the run record's config shows what was used."""
    from pipeline.core.runtime import _version

    out: dict[str, Any] = {"torch": _version("torch")}
    extra = getattr(_family_module(family_of(model_cfg)), "trace_key", None)
    if extra is not None:
        out.update(extra(model_cfg))
    return out
