"""The real models verify executes: the traced model built on CPU with small random
weights, its step inputs, and the model hash a plan file is checked against.

Every family the trace builds is built here (:data:`VERIFY_FAMILIES`): the built-in
LLaMA; an ``hf`` architecture with transformers' ``from_config`` on CPU and the attention
and experts implementation the trace used; a ``custom`` module from its ``model.builder``
inside ``torch.device("cpu")``. The forward of an ``hf`` or ``custom`` module is replaced
(on the instance) by its family's step, which is what the trace captured, so
``model(*inputs)`` returns the loss of every family.
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.core.errors import PlanError


class VerifyUsageError(PlanError):
    """A bad verify flag or a model verify cannot build (one line)."""


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
    replaced (on the instance) by the family's step (forward, then ``model.loss``),
    which is what the trace captured (the cast to ``param_dtype`` is the identity here:
    the step is verified in float32). ``custom`` family: ``model.builder`` instantiated on
    CPU, its forward replaced by the family's step likewise.
    """
    import torch

    check_model_family(model_cfg)
    family = family_of(model_cfg)
    if family == "hf":
        model = _build_real_hf(model_cfg)
    elif family == "custom":
        model = _build_real_custom(model_cfg)
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
    model.forward = functools.partial(hf.step, model.forward, task=model_cfg["task"],
                                      loss=model_cfg.get("loss", "cross_entropy"))
    return model


def _build_real_custom(model_cfg: dict[str, Any]) -> Any:
    """The ``custom`` module of ``model_cfg`` on CPU, forward replaced by the step."""
    import functools

    from pipeline.models import custom

    model = custom.instantiate(model_cfg, device="cpu")
    model.train()
    model.forward = functools.partial(custom.step, model.forward,
                                      loss=custom.loss_fn(model_cfg))
    return model


def family_of(model_cfg: dict[str, Any]) -> str:
    """``model.family`` of ``model_cfg`` (``llama`` when absent)."""
    from pipeline.models import family_of as _family_of

    return _family_of(model_cfg)


#: Model families verify builds real weights for.
VERIFY_FAMILIES: tuple[str, ...] = ("llama", "hf", "custom")


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
            "llama70b|hf/<preset>|custom)")
    if family != "llama":
        return
    extra = sorted(set(model_cfg) - set(ModelConfig.__dataclass_fields__) - {"family"})
    if extra:
        raise VerifyUsageError(
            f"model.{extra[0]}={model_cfg[extra[0]]!r}: verify builds real weights for the "
            "built-in llama family only (model=toy|llama1b|llama8b|llama70b)")


def real_inputs(model_cfg: dict[str, Any], seed: int) -> list[Any]:
    """The step's token inputs, uniform over the vocabulary, from ``seed + 1`` (the same
    on every process): token batch and labels ``[batch_size, seq_len]``; an ``hf``
    seq2seq model gets encoder tokens ``[batch_size, seq_len]``, then decoder tokens and
    labels ``[batch_size, decoder_seq_len]``. A ``custom`` model gets its step inputs
    (:func:`custom_inputs`)."""
    import torch

    gen = torch.Generator().manual_seed(int(seed) + 1)
    if family_of(model_cfg) == "custom":
        return custom_inputs(model_cfg, gen)
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


def custom_inputs(model_cfg: dict[str, Any], gen: Any) -> list[Any]:
    """The step inputs of a ``custom`` model (:func:`pipeline.models.custom.step_input_specs`:
    ``model.inputs``, then ``labels`` for ``model.loss=cross_entropy``), drawn in order from
    ``gen``: an integer input uniform in ``[0, high)`` (labels: over the output's
    classes), a floating one from N(0, 1), a bool one a fair coin."""
    import torch

    from pipeline.models.custom import step_input_specs

    out = []
    for spec in step_input_specs(model_cfg):
        shape, dtype = tuple(spec["shape"]), getattr(torch, spec["dtype"])
        if spec["dtype"] == "bool":
            out.append(torch.randint(0, 2, shape, generator=gen).bool())
        elif dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dtype))
        else:
            out.append(torch.randint(0, int(spec["high"]), shape, generator=gen, dtype=dtype))
    return out


def model_hash_of_config(model_cfg: dict[str, Any]) -> str:
    """The model hash (:func:`pipeline.plan.format.model_hash_of_module`) of ``model_cfg``'s
    module, built on meta (no weights)."""
    from pipeline.plan.format import model_hash_of_module

    if family_of(model_cfg) in ("hf", "custom"):
        from pipeline.models import build

        return model_hash_of_module(build(model_cfg).module)
    from pipeline.models.llama_decoder import build_model

    return model_hash_of_module(build_model(model_cfg))
