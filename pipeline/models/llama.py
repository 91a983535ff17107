"""The ``llama`` model family: its schema, validation and builder (torch-free).

:class:`ModelConfig` is the structured config of ``model=toy``, ``llama1b``, ...; the
config package reads it (and :func:`validate_model_config`) on every resolve, so this
module imports no torch. The dataclass and its checks live in
:mod:`pipeline.models.llama_config` (re-exported here as the family's API); the network
itself, a LLaMA-3 decoder written for tracing on the meta device, is
:mod:`pipeline.models.llama_decoder` (it imports the config module), imported when a
model is built.
"""

from __future__ import annotations

from typing import Any

from pipeline.models.llama_config import (
    ALLOWED_DTYPES,
    ModelConfig,
    ffn_hidden_dim,
    validate_model_config,
)


def build(cfg: Any) -> Any:
    """The family builder (:func:`pipeline.models.build`): the module's forward returns
    the loss, so no step function; it casts its own weights
    (:class:`pipeline.models.llama_decoder.CastLinear`)."""
    from pipeline.models import BuiltModel
    from pipeline.models.llama_decoder import build_model, example_inputs

    return BuiltModel(module=build_model(cfg), inputs=example_inputs(cfg), step=None,
                      info={"family": "llama", "architecture": "Transformer",
                            "width": int(cfg["dim"])})


#: The structured-config schema of the family (:func:`pipeline.models.schema_of`).
SCHEMA = ModelConfig
validate = validate_model_config

__all__ = ["ALLOWED_DTYPES", "SCHEMA", "ModelConfig", "build", "ffn_hidden_dim", "validate",
           "validate_model_config"]
