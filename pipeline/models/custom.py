"""The ``custom`` model family: your own ``nn.Module``, built by a Hydra ``_target_``.

``model=custom model.builder._target_=my_pkg.make_model model.builder.<kwarg>=<value>``
calls ``hydra.utils.instantiate(model.builder)`` inside ``torch.device("meta")`` (any
callable returning an ``nn.Module``: a class or a factory function, importable from the
working directory or ``PYTHONPATH``). The training step feeds the module the inputs of
``model.inputs`` (one meta tensor per ``{name, shape, dtype, high}``, in order; an
integer input holds ids below its vocabulary bound ``high``), takes the first tensor of
its output (a tensor, the first tensor of a tuple / list, ``logits`` or the first tensor
of a mapping), and a loss ``model.loss``:

* ``cross_entropy`` (default): mean cross-entropy of the output ``[..., V]`` against an
  extra int64 input ``labels`` of shape ``output.shape[:-1]`` (the built-in model's
  ``log_softmax`` + ``nll_loss_forward``);
* ``output``: the module returns the scalar loss itself (its forward computes it, e.g.
  ``F.cross_entropy(logits, labels)`` with ``labels`` one of ``model.inputs``: the trace
  keeps the backward of such composite losses, :mod:`pipeline.stages.trace.composite`);
* ``{_target_: my_pkg.loss_fn, ...}``: ``loss_fn(output, *inputs) -> scalar``; a class
  target is instantiated first (``torch.nn.MSELoss``), a function gets the other keys as
  keyword arguments.

Mixed precision as the other families: parameters in float32, cast to ``param_dtype``
inside the step (default ``float32``: no cast, since a module of your own may mix in
float32 tensors of its own).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

__all__ = ["SCHEMA", "CustomModelConfig", "InputSpec", "build", "instantiate", "loss_fn",
           "preflight", "step", "step_input_specs", "trace_key", "validate"]

LOSSES: tuple[str, ...] = ("cross_entropy", "output")
ALLOWED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
INPUT_DTYPES: tuple[str, ...] = ("int64", "int32", "float32", "bfloat16", "float16", "bool")
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TARGET_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")


@dataclass
class InputSpec:
    """One model input: ``name``, ``shape`` (positive ints), ``dtype`` and, for an integer
    input, the vocabulary bound ``high`` (ids in ``[0, high)``)."""

    name: str = MISSING
    shape: list[int] = MISSING
    dtype: str = "int64"
    high: int | None = None


@dataclass
class CustomModelConfig:
    """A module of your own (Hydra structured config).

    Attributes:
        family: ``custom``.
        name: readable key in result paths.
        builder: ``{_target_: dotted.path, <kwargs>}`` instantiated by Hydra on meta.
        inputs: the forward's inputs, in order (:class:`InputSpec`).
        loss: ``cross_entropy``, ``output`` or ``{_target_: dotted.path, ...}``.
        param_dtype, reduce_dtype: compute and gradient-reduction dtypes.
        microbatches: gradient accumulation: microbatches per step, splitting the first
            input's dim 0 (docs/pipelining.md).
        trace_env: set by ``resolve()`` (torch version, builder / loss source hashes).
    """

    family: str = "custom"
    name: str = "custom"
    builder: dict[str, Any] = field(default_factory=dict)
    inputs: list[InputSpec] = field(default_factory=list)
    loss: Any = "cross_entropy"
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    microbatches: int = 1
    trace_env: dict[str, Any] = field(default_factory=dict)


SCHEMA = CustomModelConfig


def _target(cfg: Mapping[str, Any], key: str) -> Any:
    """Import the ``_target_`` of ``cfg[key]`` (a mapping); ValueError in one line."""
    spec = cfg.get(key)
    target = spec.get("_target_") if isinstance(spec, Mapping) else None
    if not isinstance(target, str) or not _TARGET_RE.match(target):
        raise ValueError(f"model.{key}._target_={target!r}: allowed a dotted path to a "
                         "callable, e.g. my_models.make_model")
    import logging

    from hydra.utils import get_object

    # hydra.utils logs the failure itself (three lines) before raising: the one line
    # below says it all.
    hydra_log = logging.getLogger("hydra.utils")
    level = hydra_log.level
    hydra_log.setLevel(logging.CRITICAL)
    try:
        obj = get_object(target)
    except Exception as err:  # noqa: BLE001 - any import failure is the user's to fix
        cause = err.__cause__ or err
        raise ValueError(f"model.{key}._target_={target}: cannot be imported "
                         f"({type(cause).__name__}: {str(cause).strip().splitlines()[0]}); "
                         "allowed a callable importable from the working directory or "
                         "PYTHONPATH") from None
    finally:
        hydra_log.setLevel(level)
    if not callable(obj):
        raise ValueError(f"model.{key}._target_={target}: is a {type(obj).__name__}, not "
                         "callable; allowed a class or function")
    return obj


def validate(cfg: Mapping[str, Any]) -> None:
    """Checks without building the module: the builder imports, the input spec and the
    loss are well formed. Raises ``ValueError`` with one line."""
    _target(cfg, "builder")
    inputs = cfg.get("inputs")
    if not isinstance(inputs, Sequence) or isinstance(inputs, str) or not inputs:
        raise ValueError(f"model.inputs={inputs!r}: allowed a non-empty list of "
                         "{name, shape, dtype, high}")
    names = []
    for i, spec in enumerate(inputs):
        key = f"model.inputs.{i}"
        name = spec.get("name")
        if not isinstance(name, str) or not _IDENT_RE.match(name):
            raise ValueError(f"{key}.name={name!r}: allowed an identifier")
        names.append(name)
        shape = spec.get("shape")
        if (not isinstance(shape, Sequence) or isinstance(shape, str) or not shape
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                           for s in shape)):
            raise ValueError(f"{key}.shape={_show(shape)}: allowed a list of positive "
                             "integers of rank >= 1 (dim 0 is the batch)")
        dtype = spec.get("dtype")
        if dtype not in INPUT_DTYPES:
            raise ValueError(f"{key}.dtype={dtype}: allowed {', '.join(INPUT_DTYPES)}")
        high = spec.get("high")
        integer = dtype in ("int64", "int32")
        if integer and not (isinstance(high, int) and not isinstance(high, bool) and high >= 1):
            raise ValueError(f"{key}.high={high!r}: an integer input needs its vocabulary "
                             "bound, allowed a positive integer (ids in [0, high))")
        if not integer and high is not None:
            raise ValueError(f"{key}.high={high!r}: only integer inputs have a vocabulary "
                             "bound; allowed null")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"model.inputs: names must be unique ({', '.join(dup)} repeated)")
    loss = cfg.get("loss")
    if isinstance(loss, Mapping):
        _target(cfg, "loss")
    elif loss not in LOSSES:
        raise ValueError(f"model.loss={loss!r}: allowed {', '.join(LOSSES)} or "
                         "{_target_: dotted.path.to.loss_fn}")
    if loss == "cross_entropy" and "labels" in names:
        raise ValueError("model.inputs: 'labels' is the name of the input model.loss="
                         "cross_entropy adds; rename it")
    for key in ("param_dtype", "reduce_dtype"):
        if cfg.get(key) not in ALLOWED_DTYPES:
            raise ValueError(f"model.{key}={cfg.get(key)}: allowed {', '.join(ALLOWED_DTYPES)}")


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return repr(value)


def trace_key(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The builder's (and a loss target's) source file content enters the trace key, so
    editing your model retraces."""
    out = {}
    for key in ("builder", "loss"):
        if key == "loss" and not isinstance(cfg.get("loss"), Mapping):
            continue
        obj = _target(cfg, key)
        try:
            path = inspect.getsourcefile(obj)
        except TypeError:
            path = None
        if path:
            with open(path, "rb") as fh:
                out[f"{key}_source"] = hashlib.sha256(fh.read()).hexdigest()[:16]
    return out


def instantiate(cfg: Mapping[str, Any], device: str = "meta") -> Any:
    """The module of ``model.builder``, built inside ``torch.device(device)`` (meta for the
    trace; ``cpu`` for verify's real weights).

    Raises:
        ModelError: the builder fails or returns no ``nn.Module`` (one line).
    """
    import torch
    import torch.nn as nn
    from hydra.utils import instantiate as hydra_instantiate

    from pipeline.models import ModelError

    target = cfg["builder"]["_target_"]
    try:
        with torch.device(device):
            module = hydra_instantiate(dict(cfg["builder"]), _convert_="all")
    except Exception as err:  # noqa: BLE001 - the user's builder failed: one line
        cause = err.__cause__ or err
        raise ModelError(f"model.builder._target_={target}: building it failed "
                         f"({type(cause).__name__}: {str(cause).strip().splitlines()[0]})"
                         ) from None
    if not isinstance(module, nn.Module):
        raise ModelError(f"model.builder._target_={target}: returned a "
                         f"{type(module).__name__}; allowed a torch.nn.Module")
    return module


def _inputs(cfg: Mapping[str, Any]) -> tuple:
    import torch

    return tuple(torch.empty(tuple(int(s) for s in spec["shape"]),
                             dtype=getattr(torch, spec["dtype"]), device="meta")
                 for spec in cfg["inputs"])


def first_tensor(out: Any) -> Any:
    """The tensor a loss is taken of: the output itself, the first tensor of a tuple or
    list, ``logits`` (else the first tensor value) of a mapping; ``None`` if none."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        keys = list(out.keys())
        for k in (["logits"] if "logits" in keys else []) + keys:
            if isinstance(out[k], torch.Tensor):
                return out[k]
        return None
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return None


def loss_fn(cfg: Mapping[str, Any]) -> Any:
    """``model.loss`` as :func:`step` takes it: ``cross_entropy`` / ``output`` as is, a
    target instantiated (a class) or bound to its keyword arguments (a function)."""
    from hydra.utils import instantiate

    loss = cfg["loss"]
    if not isinstance(loss, Mapping):
        return loss
    obj = _target(cfg, "loss")
    if inspect.isclass(obj):
        return instantiate(dict(loss), _convert_="all")
    return instantiate(dict(loss), _partial_=True, _convert_="all")


def step(forward: Any, *inputs: Any, loss: Any) -> Any:
    """The training step: forward on the inputs, the loss of its first tensor."""
    from pipeline.models.llama_decoder import cross_entropy

    if loss == "cross_entropy":
        *feed, labels = inputs
        out = first_tensor(forward(*feed))
        return cross_entropy(out.flatten(0, -2).float(), labels.flatten())
    out = first_tensor(forward(*inputs))
    if loss == "output":
        return out
    return loss(out, *inputs)


def _probe(cfg: Mapping[str, Any], module: Any) -> tuple[Any, Any]:
    """Run the forward (and the loss) on meta once: the output tensor and the loss value.

    Raises:
        ModelError: the forward refuses the input spec, returns no tensor, or the loss is
            not a floating scalar.
    """
    import torch

    from pipeline.models import ModelError

    target = cfg["builder"]["_target_"]
    inputs = _inputs(cfg)
    spec = ", ".join(f"{s['name']}[{','.join(str(d) for d in s['shape'])}] {s['dtype']}"
                     for s in cfg["inputs"])
    try:
        with torch.no_grad():
            raw = module(*inputs)
    except Exception as err:  # noqa: BLE001 - the module refused the inputs: one line
        raise ModelError(f"model.inputs=[{spec}]: the forward of {target} fails on them "
                         f"({type(err).__name__}: {str(err).strip().splitlines()[0][:200]}); "
                         "allowed the shapes and dtypes the module takes") from None
    out = first_tensor(raw)
    if out is None:
        raise ModelError(f"model.builder._target_={target}: the forward returned "
                         f"{type(raw).__name__}, no tensor to take model.loss of; allowed a "
                         "tensor, or a tuple / list / mapping holding one")
    loss = cfg["loss"]
    if loss == "cross_entropy":
        if not out.is_floating_point() or out.dim() < 2:
            raise ModelError(f"model.loss=cross_entropy: the output of {target} is "
                             f"{list(out.shape)} {str(out.dtype).replace('torch.', '')}; "
                             "allowed floating logits [..., vocab] of rank >= 2")
        return out, None
    try:
        with torch.no_grad():
            value = out if loss == "output" else loss_fn(cfg)(out, *inputs)
    except Exception as err:  # noqa: BLE001 - the user's loss failed: one line
        raise ModelError(f"model.loss={_show_loss(loss)}: failed on the output "
                         f"{list(out.shape)} ({type(err).__name__}: "
                         f"{str(err).strip().splitlines()[0][:200]})") from None
    if not (isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()):
        got = (f"{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
               if isinstance(value, torch.Tensor) else type(value).__name__)
        raise ModelError(f"model.loss={_show_loss(loss)}: gives {got}; allowed a scalar "
                         "(0-d) floating tensor")
    return out, value


def _show_loss(loss: Any) -> str:
    if isinstance(loss, Mapping):
        return "{_target_:" + str(loss.get("_target_")) + "}"
    return str(loss)


def preflight(cfg: Mapping[str, Any]) -> None:
    """Build the module on meta and run the forward and the loss once."""
    _probe(cfg, instantiate(cfg))


def step_input_specs(cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``[{name, shape, dtype, high}]`` of every input of the training step in order:
    ``model.inputs``, then for ``model.loss=cross_entropy`` the added ``labels`` (int64,
    ``output.shape[:-1]``, ``high`` the output's class count, from a forward on meta).
    Verify draws its real inputs from these."""
    specs = [{"name": s["name"], "shape": [int(d) for d in s["shape"]], "dtype": s["dtype"],
              "high": s.get("high")} for s in cfg["inputs"]]
    if cfg["loss"] == "cross_entropy":
        out, _ = _probe(cfg, instantiate(cfg))
        specs.append({"name": "labels", "shape": [int(d) for d in out.shape[:-1]],
                      "dtype": "int64", "high": int(out.shape[-1])})
    return specs


def build(cfg: Mapping[str, Any]) -> Any:
    """Build the module on meta, its inputs (plus ``labels`` for cross-entropy) and step."""
    import torch

    from pipeline.models import BuiltModel

    module = instantiate(cfg)
    out, _ = _probe(cfg, module)
    module.train()
    inputs = _inputs(cfg)
    loss = cfg["loss"]
    if loss == "cross_entropy":
        inputs = inputs + (torch.empty(tuple(out.shape[:-1]), dtype=torch.int64,
                                       device="meta"),)
    dtype = getattr(torch, cfg["param_dtype"])
    return BuiltModel(
        module=module, inputs=inputs, step=functools.partial(step, loss=loss_fn(cfg)),
        compute_dtype=None if dtype == torch.float32 else dtype,
        info={"family": "custom", "architecture": type(module).__name__,
              "builder": cfg["builder"]["_target_"], "width": None})
