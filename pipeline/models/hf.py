"""The ``hf`` model family: any Hugging Face transformers architecture, from its config.

``model=hf model.model_type=<type> model.config.<field>=<value>`` builds
``AutoConfig.for_model(model_type, **config)`` (the fields of a ``config.json``) and the
task's auto class (``AutoModelForCausalLM`` / ``AutoModelForMaskedLM`` /
``AutoModelForSeq2SeqLM``) with ``from_config`` on the meta device: no weights, no hub
access. Presets are saved configs of this family (``conf/model/hf/*.yaml``).

The training step (:func:`step`) runs the model's forward on the token batch and takes
the loss of ``model.loss``: ``cross_entropy`` (default), the built-in LLaMA's (mean
cross-entropy as ``log_softmax`` + ``nll_loss_forward``,
:func:`pipeline.models.llama_decoder.cross_entropy`) of the logits against ``labels``; or
``output``, the model's own loss, the forward given ``labels=`` (transformers'
``loss_function``: a causal LM shifts the labels by one position and ignores the last,
through ``F.cross_entropy``, whose backward the trace keeps:
:mod:`pipeline.stages.trace.composite`). Mixed precision is the built-in model's:
parameters stored in float32 and cast to ``param_dtype`` inside the step
(:mod:`pipeline.models.step`), gradients reduced in ``reduce_dtype``.

Attention (``model.attn_implementation=fused``, the default) goes through
:func:`fused_attention`, registered with transformers' ``AttentionInterface`` under
:data:`ATTENTION_NAME`: one ``aten._scaled_dot_product_flash_attention`` node (causal or
not as the module says), as the built-in model, where transformers' ``sdpa`` path on meta
decomposes into bmm + softmax with an s x s score tensor. An additive bias (T5's relative
position bias, an explicit mask) goes to ``aten._scaled_dot_product_efficient_attention``
with ``attn_bias``. The matching mask function builds no mask: the step feeds no padding
mask and no position ids, so every sequence is one unpadded, unpacked sequence (sliding
windows are planned as full causal attention, an upper bound of their work). Softcapping
or attention sinks cannot be expressed by the fused op: such a model fails with one line
asking for ``model.attn_implementation=sdpa``.

MoE experts use transformers' ``grouped_mm`` experts implementation (default
``model.experts_implementation``): ``aten._grouped_mm`` when the experts compute in
bf16, transformers' ``grouped_mm_fallback`` custom op otherwise; the ``eager`` one indexes
with ``nonzero`` (data dependent) and is refused.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

__all__ = ["ATTENTION_NAME", "HFModelConfig", "SCHEMA", "TASKS", "build", "fused_attention",
           "preflight", "trace_key", "validate"]

#: The auto class of each task.
TASKS: dict[str, str] = {
    "causal_lm": "AutoModelForCausalLM",
    "masked_lm": "AutoModelForMaskedLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
}
#: Name of the planner's attention in transformers' Attention(Mask)Interface (a name with
#: ``flash`` in it would send transformers looking for a hub kernel).
ATTENTION_NAME = "planner_fused_sdpa"
ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("fused", "sdpa", "eager")
EXPERTS_IMPLEMENTATIONS: tuple[str, ...] = ("grouped_mm", "batched_mm")
#: ``model.loss``: the planner's cross-entropy of the logits, or the model's own loss.
LOSSES: tuple[str, ...] = ("cross_entropy", "output")
ALLOWED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
EXTRA_HINT = "install the hf extra: pip install -e '.[hf]'"
_MODEL_TYPE_RE = re.compile(r"^[a-z0-9][a-z0-9_\-]*$")


@dataclass
class HFModelConfig:
    """A transformers architecture and the training-step shape (Hydra structured config).

    Attributes:
        family: ``hf``.
        name: readable key in result paths (``gpt2``).
        model_type: transformers model type, as in a ``config.json`` (``gpt2``, ``qwen2``,
            ``mixtral``, ``bert``, ``t5``, ...).
        task: ``causal_lm``, ``masked_lm`` or ``seq2seq``.
        config: fields of the transformers config (``n_layer``, ``hidden_size``, ...);
            unknown fields are refused.
        batch_size, seq_len: global batch and sequence length of the token batch.
        microbatches: gradient accumulation: microbatches per step (docs/pipelining.md).
        decoder_seq_len: seq2seq only: decoder length (``None``: ``seq_len``).
        param_dtype, reduce_dtype: compute and gradient-reduction dtypes.
        attn_implementation: ``fused`` (the planner's fused SDPA op), or transformers'
            ``sdpa`` / ``eager``.
        experts_implementation: MoE experts: ``grouped_mm`` or ``batched_mm``.
        loss: ``cross_entropy`` (of the logits against ``labels``) or ``output`` (the
            model's own loss, the forward given ``labels=``).
        trace_env: set by ``resolve()`` (torch and transformers versions).
    """

    family: str = "hf"
    name: str = "hf"
    model_type: str = MISSING
    task: str = "causal_lm"
    config: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 8
    microbatches: int = 1
    seq_len: int = 1024
    decoder_seq_len: int | None = None
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    attn_implementation: str = "fused"
    experts_implementation: str = "grouped_mm"
    loss: str = "cross_entropy"
    trace_env: dict[str, Any] = field(default_factory=dict)


SCHEMA = HFModelConfig


def transformers_available() -> bool:
    """Whether transformers can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        return False


def _positive(cfg: Mapping[str, Any], key: str, optional: bool = False) -> None:
    val = cfg.get(key)
    if optional and val is None:
        return
    if not isinstance(val, int) or isinstance(val, bool) or val < 1:
        raise ValueError(f"model.{key}={val!r}: must be a positive integer"
                         + (" or null" if optional else ""))


def validate(cfg: Mapping[str, Any]) -> None:
    """Cheap checks (no transformers import); raise ``ValueError`` with one line."""
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or not _MODEL_TYPE_RE.match(mt):
        raise ValueError(f"model.model_type={mt!r}: allowed a transformers model type as in "
                         "a config.json (gpt2, qwen2, mixtral, bert, t5, ...)")
    if not transformers_available():
        raise ValueError(f"model.model_type={mt}: the hf model family needs the transformers "
                         f"package, which is not installed; {EXTRA_HINT}")
    if cfg.get("task") not in TASKS:
        raise ValueError(f"model.task={cfg.get('task')}: allowed {', '.join(TASKS)}")
    for key in ("batch_size", "seq_len"):
        _positive(cfg, key)
    _positive(cfg, "decoder_seq_len", optional=True)
    for key in ("param_dtype", "reduce_dtype"):
        if cfg.get(key) not in ALLOWED_DTYPES:
            raise ValueError(f"model.{key}={cfg.get(key)}: allowed {', '.join(ALLOWED_DTYPES)}")
    if cfg.get("attn_implementation") not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"model.attn_implementation={cfg.get('attn_implementation')}: allowed "
                         f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    if cfg.get("experts_implementation") not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(
            f"model.experts_implementation={cfg.get('experts_implementation')}: allowed "
            f"{', '.join(EXPERTS_IMPLEMENTATIONS)} (eager experts index with nonzero, which "
            "is data dependent)")
    if cfg.get("loss", "cross_entropy") not in LOSSES:
        raise ValueError(f"model.loss={cfg.get('loss')!r}: allowed {', '.join(LOSSES)} (the "
                         "model's own loss, given labels=)")
    if not isinstance(cfg.get("config"), Mapping):
        raise ValueError(f"model.config={cfg.get('config')!r}: allowed a mapping of "
                         "transformers config fields")


def _config_class(model_type: str) -> Any:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        known = sorted(CONFIG_MAPPING.keys())
        close = [k for k in known if k.startswith(model_type[:3])][:8] or known[:8]
        raise ValueError(f"model.model_type={model_type}: not a transformers model type "
                         f"(transformers {_transformers_version()} knows {len(known)}, e.g. "
                         f"{', '.join(close)})")
    return CONFIG_MAPPING[model_type]


def _transformers_version() -> str | None:
    from pipeline.core.runtime import _version

    return _version("transformers")


def _known_fields(config_class: Any) -> set[str]:
    default = config_class()
    return (set(default.to_dict()) | set(getattr(config_class, "attribute_map", {}))
            | {k for k in dir(config_class) if not k.startswith("_")})


def hf_config(cfg: Mapping[str, Any]) -> Any:
    """The transformers config of ``cfg`` (``AutoConfig.for_model``), fields checked.

    Raises:
        ValueError: an unknown model type, an unknown config field, a task the
            architecture has no model for, or a value transformers refuses (one line).
    """
    import transformers

    cls = _config_class(cfg["model_type"])
    fields = dict(cfg.get("config") or {})
    known = _known_fields(cls)
    for key in fields:
        if key not in known:
            raise ValueError(
                f"model.config.{key}={fields[key]!r}: not a field of {cls.__name__} "
                f"(model_type={cfg['model_type']}); allowed e.g. "
                + ", ".join(sorted(k for k in cls().to_dict() if not k.startswith("_"))[:12]))
    try:
        config = transformers.AutoConfig.for_model(cfg["model_type"], **fields)
    except Exception as err:  # transformers' (and huggingface_hub's) validators, any type
        raise ValueError(refusal(err, fields, cls, None, cls.__name__)) from None
    auto = getattr(transformers, TASKS[cfg["task"]])
    if type(config) not in auto._model_mapping:
        ok = [t for t, name in TASKS.items()
              if type(config) in getattr(transformers, name)._model_mapping]
        raise ValueError(f"model.task={cfg['task']}: {cfg['model_type']} has no "
                         f"{TASKS[cfg['task']]} model; allowed for it: "
                         + (", ".join(ok) or "none of " + ", ".join(TASKS)))
    return config


#: Names transformers' and torch's own messages use for config fields (``embed_dim``
#: in GPT-2's attention, ``padding_idx`` / ``num_embeddings`` in ``nn.Embedding``), read
#: as the field they come from when naming the keys of a refusal.
_MESSAGE_NAMES: dict[str, str] = {
    "embed_dim": "hidden_size", "hidden size": "hidden_size", "num_heads": "num_attention_heads",
    "attention heads": "num_attention_heads", "padding_idx": "pad_token_id",
    "num_embeddings": "vocab_size", "vocab": "vocab_size", "kv heads": "num_key_value_heads",
    "key_value_heads": "num_key_value_heads", "head_dim": "head_dim"}


def _root_message(err: BaseException) -> str:
    """The first line of the innermost cause of ``err`` (huggingface_hub wraps a
    validator's ``ValueError`` in a message that only names the validator)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def refusal(err: BaseException, fields: Mapping[str, Any], cls: Any, config: Any,
            what: str) -> str:
    """One line for a configuration transformers refused: the ``model.config`` keys its
    message involves, each with its value (``(default)`` when not given), then the
    message. A key is involved when its name, its alias in the config class's
    ``attribute_map``, or a name of :data:`_MESSAGE_NAMES` for it appears in the message;
    when none does, every key given is named."""
    message = _root_message(err)
    lower = message.lower()
    alias = dict(getattr(cls, "attribute_map", {}) or {})  # standard name -> own name
    own_to_std = {v: k for k, v in alias.items()}
    candidates = set(fields) | set(alias) | set(_MESSAGE_NAMES.values())
    involved: list[str] = []
    for key in sorted(candidates):
        std = own_to_std.get(key, key)
        names = {key, std, alias.get(std, std)} | {m for m, f in _MESSAGE_NAMES.items()
                                                  if f == std}
        if any(re.search(rf"(?<![a-z_]){re.escape(n.lower())}(?![a-z_])", lower)
               for n in names):
            shown = next((n for n in (key, std, alias.get(std)) if n in fields), None) or (
                alias.get(std, std))
            if shown not in involved:
                involved.append(shown)
    if config is None:
        try:
            config = cls()
        except Exception:  # the defaults themselves refused: no default values to show
            config = None

    def value(key: str) -> str:
        if key in fields:
            return repr(fields[key])
        return f"{getattr(config, key, None)!r} (default)" if config is not None else "(default)"

    keys = involved or sorted(fields)
    named = ", ".join(f"model.config.{k}={value(k)}" for k in keys) or "model.config={}"
    return f"{named}: transformers refused to build {what}: {message}"


def construct(cfg: Mapping[str, Any], config: Any) -> Any:
    """The task's model of ``config`` on the meta device, with the attention and
    experts implementation of ``cfg`` (``from_config``: no weights).

    Raises:
        ValueError: transformers (or torch, inside its modules) refused the config: one
            line naming the ``model.config`` keys involved (:func:`refusal`).
    """
    import torch
    import transformers

    auto = getattr(transformers, TASKS[cfg["task"]])
    model_class = auto._model_mapping[type(config)]
    kwargs: dict[str, Any] = {}
    attn = cfg["attn_implementation"]
    if attn == "fused":
        register_attention()
        attn = ATTENTION_NAME
    kwargs["attn_implementation"] = attn
    if model_class._can_set_experts_implementation():
        kwargs["experts_implementation"] = cfg["experts_implementation"]
    try:
        with torch.device("meta"):
            return auto.from_config(config, **kwargs)
    except Exception as err:  # raised inside transformers' modules for this config
        raise ValueError(refusal(err, dict(cfg.get("config") or {}), type(config), config,
                                 model_class.__name__)) from None


def preflight(cfg: Mapping[str, Any]) -> None:
    """Import transformers, check the model type, the config fields and the task, and
    build the model on meta (a config transformers' modules refuse is one line here,
    before any stage writes)."""
    from pipeline.models import ModelError

    try:
        construct(cfg, hf_config(cfg))
    except ValueError as err:
        raise ModelError(str(err)) from None


def trace_key(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The transformers version enters the trace key (an upgrade retraces)."""
    return {"transformers": _transformers_version()}


# --------------------------------------------------------------------------- attention


def fused_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any
                    ) -> tuple[Any, None]:
    """transformers attention interface: ``[B, H, T, D]`` q/k/v -> ``([B, T, H, D], None)``.

    Key/value heads are repeated to the query heads (GQA, as the built-in model), then
    one fused SDPA op: ``_scaled_dot_product_flash_attention`` without a bias, or
    ``_scaled_dot_product_efficient_attention`` with the additive bias of an explicit mask
    or a position bias (T5). Causal when the module (or the caller) says so and there is
    more than one query.

    Raises:
        ModelError: the module asks for softcapping or attention sinks.
    """
    import torch

    from pipeline.models import ModelError

    if kwargs.get("softcap") or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ModelError(
            f"model.attn_implementation=fused: {type(module).__name__} uses attention "
            "softcapping or sinks, which the fused SDPA op cannot express; allowed for this "
            "model: model.attn_implementation=sdpa or eager")
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        b, h, s, d = key.shape
        key = key[:, :, None].expand(b, h, rep, s, d).reshape(b, h * rep, s, d)
        b, h, s, d = value.shape
        value = value[:, :, None].expand(b, h, rep, s, d).reshape(b, h * rep, s, d)
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal) and query.shape[2] > 1
    bias = kwargs.get("position_bias")
    if attention_mask is not None:
        mask = attention_mask
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, float("-inf"))
        bias = mask if bias is None else bias + mask
    if bias is None:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, float(dropout), is_causal, scale=scaling)[0]
    else:
        b, h, t, _ = query.shape
        bias = bias.to(query.dtype).expand(b, h, t, key.shape[2])
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, float(dropout), is_causal, scale=scaling)[0]
    return out.transpose(1, 2).contiguous(), None


def _attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                    kv_offset: int = 0, mask_function: Any = None, attention_mask: Any = None,
                    **kwargs: Any) -> Any:
    """transformers mask interface of :data:`ATTENTION_NAME`: no mask without a padding
    mask (the step passes none: causality is the fused op's ``is_causal``); with one,
    transformers' own ``sdpa`` boolean mask."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, allow_is_causal_skip=False, **kwargs)


def register_attention() -> None:
    """Register :func:`fused_attention` and its mask function with transformers'
    ``AttentionInterface`` / ``AttentionMaskInterface`` (idempotent: the same functions
    under the same name)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, fused_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _attention_mask)


# --------------------------------------------------------------------------- building


def step(forward: Any, *inputs: Any, task: str, loss: str = "cross_entropy") -> Any:
    """The training step: forward on the token batch, then the cross-entropy of the
    logits against ``labels`` (``loss="cross_entropy"``) or the model's own loss, the
    forward given ``labels=`` (``loss="output"``)."""
    from pipeline.models.llama_decoder import cross_entropy

    own = {"labels": inputs[-1]} if loss == "output" else {}
    if task == "seq2seq":
        input_ids, decoder_input_ids, labels = inputs
        out = forward(input_ids=input_ids, decoder_input_ids=decoder_input_ids,
                      use_cache=False, return_dict=True, **own)
    elif task == "causal_lm":
        input_ids, labels = inputs
        out = forward(input_ids=input_ids, use_cache=False, return_dict=True, **own)
    else:
        input_ids, labels = inputs
        out = forward(input_ids=input_ids, return_dict=True, **own)
    if loss == "output":
        return out.loss
    logits = out.logits
    return cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def build(cfg: Mapping[str, Any]) -> Any:
    """Build the architecture on meta (see the module docstring)."""
    import functools

    import torch

    from pipeline.models import BuiltModel, ModelError

    try:
        config = hf_config(cfg)
        model = construct(cfg, config)
    except ValueError as err:
        raise ModelError(str(err)) from None
    model_class = type(model)
    attn = ATTENTION_NAME if cfg["attn_implementation"] == "fused" else cfg["attn_implementation"]
    model.train()
    b, t = int(cfg["batch_size"]), int(cfg["seq_len"])
    td = int(cfg.get("decoder_seq_len") or t)

    def tokens(*shape: int) -> Any:
        return torch.empty(shape, dtype=torch.int64, device="meta")

    if cfg["task"] == "seq2seq":
        inputs: tuple = (tokens(b, t), tokens(b, td), tokens(b, td))
    else:
        inputs = (tokens(b, t), tokens(b, t))
    width = getattr(config, "hidden_size", None) or getattr(config, "d_model", None)
    return BuiltModel(
        module=model, inputs=inputs,
        step=functools.partial(step, task=cfg["task"], loss=cfg.get("loss", "cross_entropy")),
        compute_dtype=getattr(torch, cfg["param_dtype"]),
        info={"family": "hf", "architecture": model_class.__name__,
              "model_type": cfg["model_type"], "task": cfg["task"],
              "width": int(width) if isinstance(width, int) else None,
              "attn_implementation": attn,
              "transformers": _transformers_version()})
