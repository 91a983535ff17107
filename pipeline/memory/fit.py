"""Whether a plan fits the device: its predicted peak against the hardware preset's
device memory, in every run (docs/reliability.md, "Does the plan fit?").

The peak is the memory model's ``memory.peak_bytes`` of the run record: the largest
sum of live bytes per device over the step (parameters, gradients, optimizer state,
saved and transient activations, gathered weights: :mod:`pipeline.memory.liveness`).
The capacity is ``hardware.device_memory_bytes`` (the preset's datasheet figure,
``conf/hardware/*.yaml``). What is compared with it is ``memory.reserved_bytes``,
``(1 + memory.reserve_fraction) * peak`` (:mod:`pipeline.memory.record`: the allocator's
caching and fragmentation, the communication library's buffers and workspaces), or the
peak itself in a record without it. A plan *fits* when ``reserved <= capacity``, and
``headroom_bytes`` says by how much.

``constraints.device_memory=auto`` makes the capacity the solve's limit
(:func:`pipeline.memory.options.device_memory_of_config`).
"""

from __future__ import annotations

from typing import Any

from pipeline.memory.options import format_bytes

__all__ = ["fit_fields", "fit_warning"]


def fit_fields(memory: dict[str, Any] | None, device_memory_bytes: int) -> dict[str, Any]:
    """The run record's fit fields: ``device_memory_bytes`` (the preset's capacity),
    ``fits`` (predicted reserved bytes per device <= capacity) and ``headroom_bytes``
    (capacity - reserved, negative when it does not fit); empty without a memory model."""
    if not memory or memory.get("peak_bytes") is None:
        return {}
    peak = _reserved(memory)
    capacity = int(device_memory_bytes)
    return {"device_memory_bytes": capacity, "fits": bool(peak <= capacity),
            "headroom_bytes": float(capacity - peak)}


def fit_warning(memory: dict[str, Any] | None, device_memory_bytes: int,
                hardware: str, limit_given: bool) -> str | None:
    """The warning line of a plan that does not fit, or None."""
    fields = fit_fields(memory, device_memory_bytes)
    if not fields or fields["fits"]:
        return None
    peak = _reserved(memory)  # type: ignore[arg-type]
    what = ("predicted reserved" if memory.get("reserved_bytes") is not None  # type: ignore[union-attr]
            else "predicted peak")
    hint = ("" if limit_given else "; constraints.device_memory=auto plans within it")
    return (f"the plan does not fit: {what} {format_bytes(peak)} per device "
            f"(at {memory.get('peak_node')}, {memory.get('peak_phase')}) > "  # type: ignore[union-attr]
            f"{format_bytes(device_memory_bytes)} of device memory "
            f"(hardware={hardware} device_memory_bytes={int(device_memory_bytes)}){hint}; "
            "or memory.activation_checkpointing, a larger mesh, a smaller batch")


def _reserved(memory: dict[str, Any]) -> float:
    """The bytes the device reserves: ``reserved_bytes``, or the peak without it."""
    value = memory.get("reserved_bytes")
    return float(memory["peak_bytes"] if value is None else value)
