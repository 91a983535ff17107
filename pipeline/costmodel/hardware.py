"""Hardware description used by the cost model.

:class:`HardwareConfig` is a Hydra structured config: only primitive fields and
nested dataclasses, every field with a default (the defaults are H100 SXM values,
the same as ``conf/hardware/h100.yaml``; each preset under ``conf/hardware/`` cites a
source per constant).

Units: FLOP/s for peaks, bytes/s for bandwidths, bytes for memory, µs for latencies and
floors.

Links. A node holds ``gpus_per_node`` GPUs joined by NVLink/NVSwitch and
``nics_per_node`` scale-out NICs (rails) of ``nic_bandwidth`` bytes/s each (one
direction). The two link tiers are :class:`LinkConfig` nodes:

* ``intra_node.bandwidth``: the NCCL *bus* bandwidth (nccl-tests ``busbw``, NCCL docs /
  nccl-tests ``doc/PERFORMANCE.md``) of a ring collective inside one node, bytes/s;
  ``intra_node.latency_us``: the fixed (base) cost of one ring pass inside a node;
  ``intra_node.hop_latency_us``: the latency of one ring step over an NVLink hop;
* ``inter_node.bandwidth``: the bandwidth of one NIC, one direction, bytes/s (the bus
  bandwidth of a ring with one GPU per node on one rail); ``inter_node.latency_us``:
  the base cost of one ring pass whose group spans nodes; ``inter_node.hop_latency_us``:
  one ring step over a network hop.

A ring pass over ``n`` ranks on ``k`` nodes takes ``n-1`` steps, ``k-1`` of them over the
network (NCCL's tuning model, ``src/graph/tuning.cc``: ``latency = baseLat +
(nsteps - nInterSteps) * intraLat + nInterSteps * interLat``); the latency formulas per
collective are :mod:`pipeline.costmodel.comm`.

``tables``: measured tables of a profile (:mod:`pipeline.costmodel.profile`), or None.

``overlap``: whether communication runs beside compute (true: a GPU, whose NCCL kernels
run on their own CUDA streams while the compute stream runs, the premise of FSDP's
prefetching, PyTorch FSDP notes "FSDP Prefetch Nuances"). False for CPU processes on
gloo: a gloo collective runs on the calling thread (``ProcessGroupGloo``'s synchronous
``wait()`` blocks it, and verify's ranks run one thread each), so no kernel runs while a
collective is in flight; ``python -m pipeline.calibrate`` writes it false for a CPU /
gloo profile. The step-time model honours it (:mod:`pipeline.costmodel.steptime`).

How a group laid out as (nodes spanned) x (members per node) turns these into one bus
bandwidth per collective is :mod:`pipeline.costmodel.comm`. ``hierarchical_all_reduce``
picks NCCL-style hierarchical all-reduce (intra reduce-scatter, inter all-reduce,
intra all-gather) instead of the flat ring for groups that span nodes.

The costs stage works with either a :class:`HardwareConfig` instance or the
``DictConfig`` Hydra builds from it: the cost functions only read attributes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.costmodel.profile import Tables, validate_tables

__all__ = [
    "COLLECTIVES",
    "HardwareConfig",
    "LinkConfig",
    "PHYSICAL_RANGES",
    "as_hardware",
    "check_physical_ranges",
    "hardware_key",
    "load_hardware",
    "tables_of",
    "validate_hardware",
]

#: Collective kinds the cost model prices (:mod:`pipeline.costmodel.comm`).
COLLECTIVES: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass
class LinkConfig:
    """One link tier: bandwidth (bytes/s), base latency of one ring pass (µs) and the
    latency of one ring step over a hop of this tier (µs).

    ``intra_node``: NVLink bus bandwidth of a ring inside a node. ``inter_node``: the
    bandwidth of one NIC in one direction. Defaults: H100 SXM NVLink 4 / NVSwitch, the
    values of ``conf/hardware/h100.yaml`` (sources there).
    """

    bandwidth: float = 390e9
    latency_us: float = 30.0
    hop_latency_us: float = 0.0


def _inter_node_default() -> LinkConfig:
    return LinkConfig(bandwidth=50e9, latency_us=40.0, hop_latency_us=0.0)


@dataclass
class HardwareConfig:
    """One accelerator type and its interconnect (defaults: NVIDIA H100 SXM, DGX H100).

    Attributes:
        name: short readable key, used in result paths (``h100``).
        peak_flops_bf16: dense bf16/fp16 tensor-core peak, FLOP/s.
        peak_flops_fp32: fp32 peak used for float32 kernels, FLOP/s.
        hbm_bandwidth: device memory bandwidth, bytes/s.
        device_memory_bytes: device memory capacity, bytes (for a memory budget; the
            cost model does not read it).
        compute_efficiency: achievable fraction of the FLOP/s peak (0, 1].
        memory_efficiency: achievable fraction of the HBM bandwidth (0, 1].
        kernel_floor_us: minimum time of any real (non-view) kernel, µs.
        gpus_per_node: GPUs of one NVLink domain; global ranks are packed
            ``gpus_per_node`` per node (see :func:`pipeline.costmodel.comm.mesh_dim_layout`).
        nics_per_node: scale-out NICs (rails) per node.
        hierarchical_all_reduce: price all-reduce over a group that spans nodes as
            intra reduce-scatter + inter all-reduce + intra all-gather instead of one ring.
        intra_node: NVLink ring bus bandwidth and latency.
        inter_node: bandwidth of one NIC (one direction), the base latency of a ring
            pass that crosses nodes and the latency of one network hop.
        tables: a measured profile's tables (:mod:`pipeline.costmodel.profile`;
            ``python -m pipeline.calibrate`` writes them), None: the constants only.
        overlap: communication overlaps compute (module docstring); false: every
            collective blocks the compute stream.
    """

    name: str = "h100"
    peak_flops_bf16: float = 989e12
    peak_flops_fp32: float = 67e12
    hbm_bandwidth: float = 3.35e12
    device_memory_bytes: int = 80 * 2**30
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.7
    kernel_floor_us: float = 7.0
    gpus_per_node: int = 8
    nics_per_node: int = 8
    hierarchical_all_reduce: bool = False
    intra_node: LinkConfig = field(default_factory=LinkConfig)
    inter_node: LinkConfig = field(default_factory=_inter_node_default)
    tables: Any = None
    overlap: bool = True

    def __post_init__(self) -> None:
        validate_hardware(self)

    def link(self, which: str) -> LinkConfig:
        """The :class:`LinkConfig` for ``"intra"`` or ``"inter"``.

        Raises:
            ValueError: for any other value.
        """
        if which == "intra":
            return self.intra_node
        if which == "inter":
            return self.inter_node
        raise ValueError(f"link must be 'intra' or 'inter', got {which!r}")


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_hardware(hw: Any) -> None:
    """Check that every rate, count, latency and efficiency of ``hw`` is in range.

    Works on a :class:`HardwareConfig` or an equivalent ``DictConfig``.

    Raises:
        ValueError: one line naming the key, the value and what is allowed.
    """

    def bad(key: str, value: Any, allowed: str) -> ValueError:
        return ValueError(f"hardware.{key}={value!r} is invalid: {allowed}")

    for key in ("peak_flops_bf16", "peak_flops_fp32", "hbm_bandwidth"):
        v = getattr(hw, key)
        if not (_is_num(v) and v > 0):
            raise bad(key, v, "must be a number > 0")
    if not (_is_int(hw.device_memory_bytes) and hw.device_memory_bytes > 0):
        raise bad("device_memory_bytes", hw.device_memory_bytes, "must be an integer > 0 (bytes)")
    for key in ("compute_efficiency", "memory_efficiency"):
        v = getattr(hw, key)
        if not (_is_num(v) and 0 < v <= 1):
            raise bad(key, v, "must be in (0, 1]")
    if not (_is_num(hw.kernel_floor_us) and hw.kernel_floor_us >= 0):
        raise bad("kernel_floor_us", hw.kernel_floor_us, "must be a number >= 0")
    for key in ("gpus_per_node", "nics_per_node"):
        v = getattr(hw, key)
        if not (_is_int(v) and v >= 1):
            raise bad(key, v, "must be an integer >= 1")
    if not isinstance(hw.hierarchical_all_reduce, bool):
        raise bad("hierarchical_all_reduce", hw.hierarchical_all_reduce, "must be true or false")
    if not isinstance(getattr(hw, "overlap", True), bool):
        raise bad("overlap", hw.overlap, "must be true or false")
    for name in ("intra_node", "inter_node"):
        link = getattr(hw, name)
        if not (_is_num(link.bandwidth) and link.bandwidth > 0):
            raise bad(f"{name}.bandwidth", link.bandwidth, "must be a number > 0 (bytes/s)")
        for key in ("latency_us", "hop_latency_us"):
            v = getattr(link, key)
            if not (_is_num(v) and v >= 0):
                raise bad(f"{name}.{key}", v, "must be a number >= 0 (µs)")
    if hw.tables is not None:
        validate_tables(hw.tables)
    check_physical_ranges(hw)


#: The physical range of each hardware value, ``key: (low, high, unit, why)``, both ends
#: included. A value outside is no device (or no link) the planner can price: such
#: values overflow the step-time sums or blame an edge of the solve instead of the key.
#: Each bound is at least 100x beyond the extremes of today's datasheets:
#:
#: * FLOP/s: the fastest single accelerator, NVIDIA B200, 4.5e15 dense FP8 and 9e15
#:   sparse FP4 (NVIDIA Blackwell datasheet, 2024); the low end, 1e6, is a thousandth
#:   of one CPU core's fp32 rate (a 3 GHz core with 16-wide FMA: ~1e11 FLOP/s).
#: * Memory bandwidth: HBM3e on B200, 8e12 B/s (same datasheet); link bandwidth: NVLink 5,
#:   1.8e12 B/s per GPU (NVIDIA NVLink page, 2024); the low end, 1e6 B/s, is below
#:   10 Mb/s Ethernet (IEEE 802.3, 1.25e6 B/s).
#: * Latencies and the kernel floor: at most 1 s (1e6 µs); a signal halfway round the
#:   Earth in fibre takes ~0.1 s (20,000 km at 2e8 m/s), no collective step takes longer.
#: * Device memory: 1 MiB to 1 PiB (B200: 192 GB HBM3e).
#: * GPUs and NICs per node: at most 4096 (NVL72 racks join 72 GPUs in one NVLink
#:   domain, NVIDIA GB200 NVL72 datasheet, 2024).
PHYSICAL_RANGES: dict[str, tuple[float, float, str, str]] = {
    "peak_flops_bf16": (1e6, 1e18, "FLOP/s", "B200: 4.5e15 dense FP8"),
    "peak_flops_fp32": (1e6, 1e18, "FLOP/s", "B200: 4.5e15 dense FP8"),
    "hbm_bandwidth": (1e6, 1e15, "bytes/s", "B200 HBM3e: 8e12"),
    "device_memory_bytes": (2**20, 2**50, "bytes", "1 MiB to 1 PiB; B200: 192 GB"),
    "kernel_floor_us": (0.0, 1e6, "µs", "at most 1 s"),
    "gpus_per_node": (1, 4096, "GPUs", "GB200 NVL72: 72"),
    "nics_per_node": (1, 4096, "NICs", "DGX H100: 8"),
    "intra_node.bandwidth": (1e6, 1e15, "bytes/s", "NVLink 5: 1.8e12"),
    "intra_node.latency_us": (0.0, 1e6, "µs", "at most 1 s"),
    "inter_node.bandwidth": (1e6, 1e15, "bytes/s", "NVLink 5: 1.8e12"),
    "inter_node.latency_us": (0.0, 1e6, "µs", "at most 1 s"),
}


def check_physical_ranges(hw: Any) -> None:
    """Check every value of :data:`PHYSICAL_RANGES` (after :func:`validate_hardware`'s
    sign and type checks).

    Raises:
        ValueError: one line naming the key, the value, the range and its source.
    """
    for key, (low, high, unit, why) in PHYSICAL_RANGES.items():
        obj = hw
        for part in key.split("."):
            obj = getattr(obj, part)
        if not low <= obj <= high:
            raise ValueError(f"hardware.{key}={obj!r} is invalid: allowed the physical range "
                             f"[{low:g}, {high:g}] {unit} ({why}; sources in "
                             "pipeline/costmodel/hardware.py PHYSICAL_RANGES)")


def hardware_key(hw: Any) -> tuple:
    """A hashable tuple of every field of ``hw`` (dataclass or DictConfig).

    Used to key caches that depend on the hardware.
    """
    return (
        str(hw.name),
        float(hw.peak_flops_bf16),
        float(hw.peak_flops_fp32),
        float(hw.hbm_bandwidth),
        int(hw.device_memory_bytes),
        float(hw.compute_efficiency),
        float(hw.memory_efficiency),
        float(hw.kernel_floor_us),
        int(hw.gpus_per_node),
        int(hw.nics_per_node),
        bool(hw.hierarchical_all_reduce),
        float(hw.intra_node.bandwidth),
        float(hw.intra_node.latency_us),
        float(hw.intra_node.hop_latency_us),
        float(hw.inter_node.bandwidth),
        float(hw.inter_node.latency_us),
        float(hw.inter_node.hop_latency_us),
        _tables_digest(hw.tables),
        bool(getattr(hw, "overlap", True)),
    )


def _tables_digest(tables: Any) -> str:
    """A short digest of a profile's tables ('' for none), for :func:`hardware_key`."""
    if tables is None:
        return ""
    import hashlib
    import json

    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(tables) if OmegaConf.is_config(tables) else tables
    text = json.dumps(plain, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tables_of(hw: Any) -> Tables | None:
    """The parsed :class:`~pipeline.costmodel.profile.Tables` of ``hw``, or None.

    A :class:`HardwareConfig` keeps its parsed tables (and their lookup counters) on
    the instance, so every cost function given the same config shares one; a
    ``DictConfig`` gets a fresh parse.
    """
    raw = getattr(hw, "tables", None)
    if raw is None:
        return None
    if isinstance(hw, HardwareConfig):
        cached = hw.__dict__.get("_parsed_tables")
        if cached is None:
            cached = hw.__dict__["_parsed_tables"] = Tables(raw)
        return cached
    return Tables(raw)


def as_hardware(hw: Any) -> HardwareConfig:
    """``hw`` as a :class:`HardwareConfig` (a ``DictConfig`` of the hardware group is
    converted once, with the same values: reading a ``DictConfig`` attribute costs
    ~40 µs, and the compute model reads a handful per op)."""
    if isinstance(hw, HardwareConfig):
        return hw
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(HardwareConfig), hw)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def load_hardware(path: str) -> HardwareConfig:
    """Load a hardware yaml (e.g. ``conf/hardware/h100.yaml``) validated against the schema.

    Raises:
        omegaconf.errors.ConfigKeyError: for a key the dataclass does not have.
        omegaconf.errors.ValidationError: for a value of the wrong type.
    """
    from omegaconf import OmegaConf

    data = OmegaConf.load(path)
    if "defaults" in data:
        data.pop("defaults")
    merged = OmegaConf.merge(OmegaConf.structured(HardwareConfig), data)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]
