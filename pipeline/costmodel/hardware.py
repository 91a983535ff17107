"""Hardware description used by the cost model.

:class:`HardwareConfig` is a Hydra structured config: only primitive fields and
nested dataclasses, every field with a default (the defaults are H100 SXM values,
the same as ``conf/hardware/h100.yaml``; that file cites a source per constant).

Units: FLOP/s for peaks, bytes/s for bandwidths, µs for latencies and floors.
Collective bandwidths are NCCL *bus* bandwidths (NCCL docs, "performance.md"):
the time of a ring collective on ``n`` ranks is
``latency + factor(n) * bytes / bus_bw`` with ``factor = (n-1)/n`` for
all-gather / reduce-scatter / all-to-all and ``2(n-1)/n`` for all-reduce; see
:mod:`pipeline.costmodel.comm`.

The costs stage works with either a :class:`HardwareConfig` instance or the
``DictConfig`` Hydra builds from it: the cost functions only read attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COLLECTIVES",
    "HardwareConfig",
    "LinkConfig",
    "hardware_key",
    "load_hardware",
    "validate_hardware",
]

#: Collective kinds with a bandwidth and latency in :class:`LinkConfig`.
COLLECTIVES: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass
class LinkConfig:
    """Per-collective NCCL bus bandwidth (bytes/s) and fixed latency (µs) of one link class.

    Defaults are the H100 SXM intra-node (NVLink 4 / NVSwitch, 8 GPUs) values.
    """

    all_gather_bw: float = 390e9
    all_gather_latency_us: float = 30.0
    reduce_scatter_bw: float = 390e9
    reduce_scatter_latency_us: float = 30.0
    all_reduce_bw: float = 270e9
    all_reduce_latency_us: float = 31.0
    all_to_all_bw: float = 390e9
    all_to_all_latency_us: float = 30.0

    def bw(self, kind: str) -> float:
        """Bus bandwidth in bytes/s of collective ``kind`` (one of :data:`COLLECTIVES`)."""
        return float(getattr(self, f"{kind}_bw"))

    def latency_us(self, kind: str) -> float:
        """Fixed latency in µs of collective ``kind`` (one of :data:`COLLECTIVES`)."""
        return float(getattr(self, f"{kind}_latency_us"))


def _inter_node_default() -> LinkConfig:
    return LinkConfig(
        all_gather_bw=50e9,
        all_gather_latency_us=40.0,
        reduce_scatter_bw=50e9,
        reduce_scatter_latency_us=40.0,
        all_reduce_bw=50e9,
        all_reduce_latency_us=41.0,
        all_to_all_bw=50e9,
        all_to_all_latency_us=40.0,
    )


@dataclass
class HardwareConfig:
    """One accelerator type and its interconnect (defaults: NVIDIA H100 SXM, 8 GPUs/node).

    Attributes:
        name: short readable key, used in result paths (``h100``).
        peak_flops_bf16: dense bf16/fp16 tensor-core peak, FLOP/s.
        peak_flops_fp32: fp32 peak used for float32 kernels, FLOP/s.
        hbm_bandwidth: device memory bandwidth, bytes/s.
        compute_efficiency: achievable fraction of the FLOP/s peak (0, 1].
        memory_efficiency: achievable fraction of the HBM bandwidth (0, 1].
        kernel_floor_us: minimum time of any real (non-view) kernel, µs.
        gpus_per_node: GPUs sharing the intra-node link; decides which mesh dims are
            intra-node (see :func:`pipeline.costmodel.comm.mesh_dim_link`).
        intra_node: collective bandwidths/latencies inside a node.
        inter_node: collective bandwidths/latencies across nodes (per GPU).
    """

    name: str = "h100"
    peak_flops_bf16: float = 989e12
    peak_flops_fp32: float = 67e12
    hbm_bandwidth: float = 3.35e12
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.7
    kernel_floor_us: float = 7.0
    gpus_per_node: int = 8
    intra_node: LinkConfig = field(default_factory=LinkConfig)
    inter_node: LinkConfig = field(default_factory=_inter_node_default)

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


def validate_hardware(hw: Any) -> None:
    """Check that every rate, latency and efficiency of ``hw`` is in range.

    Works on a :class:`HardwareConfig` or an equivalent ``DictConfig``.

    Raises:
        ValueError: one line naming the key, the value and what is allowed.
    """

    def bad(key: str, value: Any, allowed: str) -> ValueError:
        return ValueError(f"hardware.{key}={value!r} is invalid: {allowed}")

    for key in ("peak_flops_bf16", "peak_flops_fp32", "hbm_bandwidth"):
        v = getattr(hw, key)
        if not (isinstance(v, (int, float)) and v > 0):
            raise bad(key, v, "must be a number > 0")
    for key in ("compute_efficiency", "memory_efficiency"):
        v = getattr(hw, key)
        if not (isinstance(v, (int, float)) and 0 < v <= 1):
            raise bad(key, v, "must be in (0, 1]")
    if not (isinstance(hw.kernel_floor_us, (int, float)) and hw.kernel_floor_us >= 0):
        raise bad("kernel_floor_us", hw.kernel_floor_us, "must be a number >= 0")
    if not (isinstance(hw.gpus_per_node, int) and hw.gpus_per_node >= 1):
        raise bad("gpus_per_node", hw.gpus_per_node, "must be an integer >= 1")
    for name in ("intra_node", "inter_node"):
        link = getattr(hw, name)
        for kind in COLLECTIVES:
            bw = getattr(link, f"{kind}_bw")
            lat = getattr(link, f"{kind}_latency_us")
            if not (isinstance(bw, (int, float)) and bw > 0):
                raise bad(f"{name}.{kind}_bw", bw, "must be a number > 0 (bytes/s)")
            if not (isinstance(lat, (int, float)) and lat >= 0):
                raise bad(f"{name}.{kind}_latency_us", lat, "must be a number >= 0 (µs)")


def hardware_key(hw: Any) -> tuple:
    """A hashable tuple of every numeric field of ``hw`` (dataclass or DictConfig).

    Used to key caches that depend on the hardware.
    """
    links = []
    for link in (hw.intra_node, hw.inter_node):
        for kind in COLLECTIVES:
            links.append(float(getattr(link, f"{kind}_bw")))
            links.append(float(getattr(link, f"{kind}_latency_us")))
    return (
        str(hw.name),
        float(hw.peak_flops_bf16),
        float(hw.peak_flops_fp32),
        float(hw.hbm_bandwidth),
        float(hw.compute_efficiency),
        float(hw.memory_efficiency),
        float(hw.kernel_floor_us),
        int(hw.gpus_per_node),
        *links,
    )


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
