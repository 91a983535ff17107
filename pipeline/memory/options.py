"""What the memory model is told about the training step: optimizer, checkpointing, FSDP.

These are plain values (no Hydra, no torch) so the solvers' side of the pipeline and
the tests can build them directly; the configuration layer turns ``optimizer.*``,
``memory.*`` and ``fsdp.*`` into a :class:`MemoryOptions` with :func:`memory_options`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# --------------------------------------------------------------------------- schema

#: Default ``memory.reserve_fraction``: FITTED (a calibration, not a measurement) on the
#: published torchtitan run Llama 3.1 8B, FSDP on 8 H100, local batch 2 x 8192,
#: selective AC, eager: 82.4 GiB reserved (torchtitan
#: ``benchmarks/llama3_h100_202412_torchtitan.md``, Table 1) over this model's liveness
#: peak of that step, 66.89 GiB: 82.4 / 66.89 = 1.232, rounded to 0.23. The compiled run
#: of the same table (77.0 GiB) is a check, not fitted: the model's peak ignores what
#: compilation saves, so it predicts the eager figure for both (+7 %).
#: tests/integration/test_anchors.py holds both.
RESERVE_FRACTION = 0.23


@dataclass
class OptimizerConfig:
    """The optimizer whose state the devices hold (Hydra group ``optimizer/``).

    Attributes:
        name: ``adamw``, ``sgd`` or ``none`` (:data:`OPTIMIZERS`).
        momentum: SGD momentum (>= 0); a momentum buffer is kept when > 0.
        state_dtype: dtype of the state tensors (float32, bfloat16, float16).
    """

    name: str = "adamw"
    momentum: float = 0.0
    state_dtype: str = "float32"


@dataclass
class MemoryConfig:
    """How the step trades memory for compute (``memory.*``).

    Attributes:
        activation_checkpointing: ``none``, ``full``, ``selective`` (torchtitan's
            op-level policy) or ``selective_all_matmuls`` (the earlier rule: every
            matmul output kept); pipeline/memory/graph.py states the rules.
        reserve_fraction: what a device reserves beyond the liveness peak, as a
            fraction of it (allocator caching and fragmentation, communication buffers,
            workspaces): it holds ``(1 + reserve_fraction) * peak``, the figure
            ``constraints.device_memory`` bounds (pipeline/memory/constraint.py).
            Default :data:`RESERVE_FRACTION` (its source there).
    """

    activation_checkpointing: str = "none"
    reserve_fraction: float = RESERVE_FRACTION


@dataclass
class FsdpConfig:
    """FSDP2 behaviour the memory model follows (``fsdp.*``).

    Attributes:
        reshard_after_forward: free a weight gathered for forward after its last forward
            use and gather it again for backward (FSDP2's default), or keep it. The
            cost model pays the second all-gather (pipeline/costmodel/fsdp.py).
        bucket_collectives: the collectives of one FSDP unit's parameters (and their
            gradients) of one kind on one mesh dim pay one latency, as FSDP2's one
            all-gather / reduce-scatter per unit (pipeline/costmodel/fsdp.py); false:
            one latency per parameter.
    """

    reshard_after_forward: bool = True
    bucket_collectives: bool = True


_STATE_DTYPES = ("float32", "bfloat16", "float16")

__all__ = [
    "CHECKPOINTING",
    "OPTIMIZERS",
    "FsdpConfig",
    "MemoryConfig",
    "MemoryOptions",
    "OptimizerConfig",
    "RESERVE_FRACTION",
    "format_bytes",
    "memory_options",
    "optimizer_state_per_element",
    "parse_bytes",
    "validate_memory_config",
]


#: ``memory.activation_checkpointing`` values (pipeline/memory/__init__.py states the rules).
CHECKPOINTING = ("none", "full", "selective", "selective_all_matmuls")

#: Optimizers the model knows, with the number of state tensors each keeps per
#: parameter element (each shaped and sharded like its parameter):
#: ``adamw`` the first and second moments (``exp_avg``, ``exp_avg_sq``; Loshchilov &
#: Hutter 2019, algorithm 2; ``torch.optim.AdamW`` keeps them in the parameter's dtype,
#: here the state dtype); ``sgd`` one momentum buffer when ``momentum > 0``
#: (``torch.optim.SGD``'s ``momentum_buffer``), none without momentum; ``none`` nothing
#: (gradients only, e.g. an inference-style or an externally offloaded optimizer).
OPTIMIZERS = ("adamw", "sgd", "none")


def optimizer_state_per_element(name: str, momentum: float = 0.0) -> int:
    """State tensors per parameter element of optimizer ``name`` (see :data:`OPTIMIZERS`).

    Raises ValueError for an unknown name.
    """
    if name == "adamw":
        return 2
    if name == "sgd":
        return 1 if momentum > 0 else 0
    if name == "none":
        return 0
    raise ValueError(f"optimizer.name={name!r}: allowed {', '.join(OPTIMIZERS)}")


@dataclass(frozen=True)
class MemoryOptions:
    """The facts of the training step the memory model needs beyond the graph.

    Attributes:
        optimizer: optimizer name (:data:`OPTIMIZERS`).
        state_tensors: optimizer state tensors per parameter element.
        state_itemsize: bytes per optimizer-state element (4: float32).
        checkpointing: one of :data:`CHECKPOINTING`.
        reshard_after_forward: FSDP2's ``reshard_after_forward``: a weight gathered in
            forward is freed after its last forward use and gathered again in backward
            (True, FSDP2's default), or kept until its last backward use (False).
        reserve_fraction: ``memory.reserve_fraction`` (>= 0): the device reserves
            ``(1 + reserve_fraction)`` times the liveness peak (0 here unless told: the
            config's default is :data:`RESERVE_FRACTION`).
    """

    optimizer: str = "adamw"
    state_tensors: int = 2
    state_itemsize: int = 4
    checkpointing: str = "none"
    reshard_after_forward: bool = True
    reserve_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"memory.activation_checkpointing={self.checkpointing!r}: "
                             f"allowed {', '.join(CHECKPOINTING)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer.name={self.optimizer!r}: allowed {', '.join(OPTIMIZERS)}")
        check_reserve_fraction(self.reserve_fraction)


def check_reserve_fraction(value: Any) -> float:
    """``memory.reserve_fraction`` as a float; ValueError (one line) unless it is a finite
    number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise ValueError(f"memory.reserve_fraction={value}: allowed a number >= 0 (the "
                         "fraction of the liveness peak a device reserves beyond it)")
    return float(value)


def validate_memory_config(cfg: Any) -> None:
    """Check ``optimizer.*``, ``memory.*``, ``fsdp.*`` and ``constraints.device_memory`` of
    a composed config; raise ValueError with a one-line message naming key, value and
    what is allowed."""
    opt = cfg.optimizer
    if opt.name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name={opt.name}: allowed {', '.join(OPTIMIZERS)}")
    momentum = opt.momentum
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not (
            math.isfinite(momentum) and momentum >= 0):
        raise ValueError(f"optimizer.momentum={momentum}: allowed a number >= 0")
    if opt.state_dtype not in _STATE_DTYPES:
        raise ValueError(f"optimizer.state_dtype={opt.state_dtype}: allowed "
                         f"{', '.join(_STATE_DTYPES)}")
    mode = cfg.memory.activation_checkpointing
    if mode not in CHECKPOINTING:
        raise ValueError(f"memory.activation_checkpointing={mode}: allowed "
                         f"{', '.join(CHECKPOINTING)}")
    check_reserve_fraction(cfg.memory.reserve_fraction)
    limit = cfg.constraints.device_memory
    if limit is not None and not is_auto(limit):
        try:
            parse_bytes(limit)
        except ValueError as err:
            raise ValueError(f"{err}; or {DEVICE_MEMORY_AUTO} (the hardware preset's "
                             "device_memory_bytes)") from None


#: ``constraints.device_memory`` value that takes the hardware preset's
#: ``device_memory_bytes`` as the limit (:func:`device_memory_of_config`).
DEVICE_MEMORY_AUTO = "auto"


def is_auto(value: Any) -> bool:
    """Whether a ``constraints.device_memory`` value is :data:`DEVICE_MEMORY_AUTO`."""
    return isinstance(value, str) and value.strip().lower() == DEVICE_MEMORY_AUTO


def memory_options(optimizer: Any = None, memory: Any = None, fsdp: Any = None) -> MemoryOptions:
    """Build :class:`MemoryOptions` from the ``optimizer``, ``memory`` and ``fsdp``
    config nodes (mappings or None for the defaults)."""
    import torch

    opt = dict(optimizer or {})
    name = str(opt.get("name", "adamw"))
    momentum = float(opt.get("momentum", 0.0) or 0.0)
    state_dtype = getattr(torch, str(opt.get("state_dtype", "float32")))
    mem = dict(memory or {})
    fs = dict(fsdp or {})
    return MemoryOptions(
        optimizer=name, state_tensors=optimizer_state_per_element(name, momentum),
        state_itemsize=int(state_dtype.itemsize),
        checkpointing=str(mem.get("activation_checkpointing", "none")),
        reshard_after_forward=bool(fs.get("reshard_after_forward", True)),
        reserve_fraction=float(mem.get("reserve_fraction", 0.0)))


_UNITS = {"": 1, "b": 1,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: Any, key: str = "constraints.device_memory") -> int:
    """A positive byte count from ``80GiB``, ``80GB`` (10^9), ``1.5TiB``, ``8e10`` or an int.

    Units (case-insensitive): B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers
    of 1024). Raises ValueError with a one-line message naming ``key`` and the value.
    """
    allowed = ("allowed a positive size such as 80GiB, 80GB, 1.5TiB or a byte count "
               "(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    if isinstance(value, bool):
        raise ValueError(f"{key}={value!r}: {allowed}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = _BYTES_RE.match(str(value))
        if m is None:
            raise ValueError(f"{key}={value}: {allowed}")
        number, unit = float(m.group(1)), m.group(2).lower()
        if unit not in _UNITS:
            raise ValueError(f"{key}={value}: unknown unit {m.group(2)!r}; {allowed}")
    nbytes = number * _UNITS[unit]
    if not math.isfinite(nbytes) or nbytes < 1:
        raise ValueError(f"{key}={value}: must be at least 1 byte; {allowed}")
    return int(nbytes)


def format_bytes(nbytes: float) -> str:
    """``85899345920`` -> ``80.00 GiB`` (binary units, for messages)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.2f} TiB"  # pragma: no cover


def options_of_config(cfg: Any) -> MemoryOptions:
    """:class:`MemoryOptions` of a resolved run config (``optimizer``, ``memory``,
    ``fsdp``; missing groups take their defaults)."""
    def plain(node: Any) -> Any:
        if node is None:
            return None
        try:
            from omegaconf import OmegaConf

            return OmegaConf.to_container(node, resolve=True)
        except ValueError:
            return dict(node)

    get = cfg.get if hasattr(cfg, "get") else (lambda k, d=None: getattr(cfg, k, d))
    return memory_options(plain(get("optimizer", None)), plain(get("memory", None)),
                          plain(get("fsdp", None)))


def device_memory_of_config(cfg: Any) -> tuple[int | None, str | None]:
    """``constraints.device_memory`` of a run config: ``(bytes, text as given)`` or
    ``(None, None)`` when unset; ``auto`` is the hardware preset's
    ``device_memory_bytes`` (text ``auto (<hardware> device_memory_bytes)``). Raises
    ValueError for a bad value (one line)."""
    constraints = cfg.get("constraints", None) if hasattr(cfg, "get") else None
    value = constraints.get("device_memory", None) if constraints is not None else None
    if value is None:
        return None, None
    if is_auto(value):
        hw = cfg.get("hardware", None)
        return (int(hw.device_memory_bytes),
                f"{DEVICE_MEMORY_AUTO} ({hw.get('name', 'hardware')} device_memory_bytes)")
    return parse_bytes(value), str(value)
