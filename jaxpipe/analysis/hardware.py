"""The accelerator chips jaxpipe knows, each once, with the figures the analysis reads.

`CATALOG` holds one `Entry` per chip under the short name compile-only targets use
(``"h100"``, ``"v5p"``): the chip's memory (`Chip`: what one device's program must fit in,
for `jaxpipe.target`), its peak figures (`Accelerator`: for the rooflines of
`jaxpipe.costs`), and for a GPU the description its compiler needs to compile for it on a
machine without one. Every figure names its source. `ACCELERATORS` is the catalog's peak
figures by chip name (``jaxpipe.costs.ACCELERATORS``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "ACCELERATORS",
    "CATALOG",
    "PRECISIONS",
    "Accelerator",
    "Chip",
    "Entry",
    "Link",
    "Links",
    "get_accelerator",
    "positive_number",
]

GiB = 2**30
PRECISIONS = ("bf16", "fp32")


def positive_number(value) -> bool:
    """Whether ``value`` is a finite number above 0 (not a bool)."""
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's memory (HBM), and where that figure comes from.

    Attributes:
        name: what the chip is called, e.g. ``"TPU v5p"``.
        memory_bytes: bytes of memory on the chip.
        source: where ``memory_bytes`` comes from.
    """

    name: str
    memory_bytes: int
    source: str


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """Peak figures of one accelerator chip (a GPU, or a TPU chip).

    Attributes:
        name: what it is called, e.g. ``"H100"``.
        peak_flops: dense (no sparsity) bf16 matmul FLOP/s.
        memory_bandwidth: HBM bandwidth in bytes/s.
        source: where the figures come from (datasheet name and URL).
        peak_flops_fp32: FLOP/s of float32 matmuls at JAX's default precision, or None if
            unknown (then float32 stages need ``precision="bf16"``).
        interconnect_bandwidth: bytes/s one way from one chip to one pipeline neighbour
            (NVLink, ICI), or None if unknown.
        interconnect_source: where ``interconnect_bandwidth`` comes from.

    Raises:
        ValueError: a figure that is not a positive finite number.
    """

    name: str
    peak_flops: float
    memory_bandwidth: float
    source: str
    peak_flops_fp32: float | None = None
    interconnect_bandwidth: float | None = None
    interconnect_source: str = ""

    def __post_init__(self):
        for field in (
            "peak_flops",
            "memory_bandwidth",
            "peak_flops_fp32",
            "interconnect_bandwidth",
        ):
            value = getattr(self, field)
            if value is None and field in ("peak_flops_fp32", "interconnect_bandwidth"):
                continue
            if not positive_number(value):
                raise ValueError(
                    f"Accelerator({self.name!r}).{field} must be a positive finite number "
                    f"(FLOP/s or bytes/s), got {value!r}"
                )

    def peak(self, precision: str) -> float:
        """Peak FLOP/s at a precision.

        Args:
            precision: ``"bf16"`` or ``"fp32"``.

        Returns:
            ``peak_flops`` or ``peak_flops_fp32``.

        Raises:
            ValueError: an unknown precision, or ``"fp32"`` on a chip with no float32 figure.
        """
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if precision == "bf16":
            return self.peak_flops
        if self.peak_flops_fp32 is None:
            raise ValueError(
                f"Accelerator {self.name!r} has no float32 figure (peak_flops_fp32=None); "
                "pass precision='bf16' to estimate at the bf16 peak, cast the stage to "
                "bfloat16, or give the Accelerator a peak_flops_fp32"
            )
        return self.peak_flops_fp32


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link between devices, and where its figure comes from.

    Attributes:
        name: what it is called, e.g. ``"ICI"``, ``"NVLink"``, ``"network"``.
        bandwidth: bytes/s one device sends one way over it.
        source: where ``bandwidth`` comes from.
    """

    name: str
    bandwidth: float
    source: str


@dataclasses.dataclass(frozen=True)
class Links:
    """The links a chip's devices reach each other over.

    Attributes:
        within: the link between devices of one node (NVLink), or of one slice (TPU ICI).
        across: the link between nodes (a GPU's network card), or None where every device
            of a target shares ``within``.
        devices_per_node: devices that ``within`` joins (a GPU node's, a TPU slice's), or
            None (all).
        by_slice: a device's node is its ``slice_index`` (TPU slices joined by the data
            center network), not its ``id`` over ``devices_per_node``.
    """

    within: Link
    across: Link | None = None
    devices_per_node: int | None = None
    by_slice: bool = False

    def node_of(self, device) -> int:
        """The node (GPU node, TPU slice) ``device`` belongs to."""
        if self.by_slice:
            return int(getattr(device, "slice_index", 0) or 0)
        return device.id // (self.devices_per_node or 1)

    def of_groups(self, groups, devices) -> Link:
        """The link a collective's device groups cross: ``across`` where a group holds
        devices of more than one node, else ``within``.

        Args:
            groups: device groups as mesh positions (`jaxpipe.analysis.hlo.device_groups`).
            devices: the mesh's devices in mesh order (``mesh.devices.flat``), whose ``id``
                numbers the devices node by node.
        """
        if self.across is None or self.devices_per_node is None:
            return self.within
        for group in groups:
            nodes = {self.node_of(devices[i]) for i in group if i < len(devices)}
            if len(nodes) > 1:
                return self.across
        return self.within


class Entry(NamedTuple):
    """What jaxpipe knows of one chip.

    Attributes:
        platform: ``"tpu"`` or ``"cuda"``: the compiler that compiles for it.
        memory: its memory, or None where the catalog has no figure.
        peaks: its peak figures, or None where the catalog has none.
        gpu_config: for a GPU, its description as the CUDA compiler reads it (an XLA
            ``GpuTargetConfig``), or None.
        links: the links between its devices, or None where the catalog has no figure.
    """

    platform: str
    memory: Chip | None
    peaks: Accelerator | None
    gpu_config: str | None = None
    links: Links | None = None


_JAX_PRECISION = (
    "float32 figure: JAX's default matmul precision runs float32 dots as {how} "
    "(https://docs.jax.dev/en/latest/201/precision.html)"
)
_NVIDIA_LINK = "NVLink {total} GB/s total (both directions) per GPU; half of it one way"
_TPU_LINK = "bidirectional ICI {total} GB/s per chip over {ports} ports; one port, one way"
_TPU_DOCS = "Cloud TPU {gen} docs, https://cloud.google.com/tpu/docs/{gen}"

# NVIDIA H100 SXM 80GB as the CUDA compiler needs it described (an XLA GpuTargetConfig):
# figures as CUDA's deviceQuery reports them for "NVIDIA H100 80GB HBM3", bandwidth from
# NVIDIA's H100 datasheet (SXM: 3.35 TB/s).
_H100_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 85045477376 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


# The data center network between TPU slices, per chip, one way, where Google publishes it.
DCN: dict[str, Link] = {
    "v5p": Link(
        "DCN",
        50e9 / 8,
        "TPU v5p docs, key specifications: data center network (DCN) bandwidth per chip "
        "50 Gbps, https://docs.cloud.google.com/tpu/docs/v5p",
    ),
}


def _tpu_memory(gen: str, gib: int, kind: str) -> Chip:
    return Chip(f"TPU {gen}", gib * GiB, _TPU_DOCS.format(gen=gen) + f": {gib} GiB {kind} per chip")


def _tpu_links(peaks: Accelerator) -> Links:
    """ICI, every chip of a slice (one link, one way: a ring that uses both directions of
    its links moves twice as much)."""
    return Links(Link("ICI", peaks.interconnect_bandwidth, peaks.interconnect_source))


def _gpu_links(peaks: Accelerator, datasheet: str) -> Links:
    """NVLink within an 8-GPU node; across nodes, one 400 Gb/s network card per GPU."""
    return Links(
        Link("NVLink", peaks.interconnect_bandwidth, peaks.interconnect_source),
        Link(
            "network",
            50e9,
            f"{datasheet}: 8 ConnectX-7 400 Gb/s InfiniBand/Ethernet ports per 8-GPU node, "
            "one per GPU: 400 Gb/s = 50 GB/s one way",
        ),
        devices_per_node=8,
    )


_DGX_H100 = "NVIDIA DGX H100 datasheet, https://www.nvidia.com/en-us/data-center/dgx-h100/"

CATALOG: dict[str, Entry] = {
    "h100": Entry(
        "cuda",
        Chip(
            "NVIDIA H100 SXM 80GB",
            85045477376,
            "CUDA deviceQuery, 'NVIDIA H100 80GB HBM3': 81,106 MiB global memory; JAX "
            "preallocates 75% of it unless XLA_PYTHON_CLIENT_MEM_FRACTION says more",
        ),
        Accelerator(
            name="H100",
            peak_flops=989.5e12,  # 1,979 TFLOPS bf16 with sparsity
            peak_flops_fp32=494.5e12,  # TF32 989 TFLOPS with sparsity
            memory_bandwidth=3.35e12,
            source=(
                "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (dense = half the "
                "sparsity figure), https://www.nvidia.com/en-us/data-center/h100/; "
                + _JAX_PRECISION.format(how="TF32 on tensor cores")
            ),
            interconnect_bandwidth=450e9,
            interconnect_source="H100 datasheet: " + _NVIDIA_LINK.format(total=900),
        ),
        _H100_CONFIG,
    ),
    "h200": Entry(
        "cuda",
        None,
        Accelerator(
            name="H200",
            peak_flops=989.5e12,
            peak_flops_fp32=494.5e12,
            memory_bandwidth=4.8e12,
            source=(
                "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (dense = half the "
                "sparsity figure), https://www.nvidia.com/en-us/data-center/h200/; "
                + _JAX_PRECISION.format(how="TF32 on tensor cores")
            ),
            interconnect_bandwidth=450e9,
            interconnect_source="H200 datasheet: " + _NVIDIA_LINK.format(total=900),
        ),
    ),
    "a100": Entry(
        "cuda",
        None,
        Accelerator(
            name="A100",
            peak_flops=312e12,
            peak_flops_fp32=156e12,  # TF32 dense
            memory_bandwidth=2.039e12,
            source=(
                "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column (dense figures), "
                "https://www.nvidia.com/en-us/data-center/a100/; "
                + _JAX_PRECISION.format(how="TF32 on tensor cores")
            ),
            interconnect_bandwidth=300e9,
            interconnect_source="A100 datasheet: " + _NVIDIA_LINK.format(total=600),
        ),
    ),
    "v4": Entry("tpu", _tpu_memory("v4", 32, "HBM2"), None),
    "v5e": Entry(
        "tpu",
        _tpu_memory("v5e", 16, "HBM2"),
        Accelerator(
            name="TPU v5e",
            peak_flops=197e12,
            peak_flops_fp32=197e12,
            memory_bandwidth=819e9,
            source=(
                "Google Cloud TPU v5e documentation, key chip specifications, "
                "https://cloud.google.com/tpu/docs/v5e; "
                + _JAX_PRECISION.format(how="one bfloat16 MXU pass")
            ),
            interconnect_bandwidth=50e9,
            interconnect_source="TPU v5e docs: " + _TPU_LINK.format(total=400, ports=4),
        ),
    ),
    "v5p": Entry(
        "tpu",
        _tpu_memory("v5p", 95, "HBM2e"),
        Accelerator(
            name="TPU v5p",
            peak_flops=459e12,
            peak_flops_fp32=459e12,
            memory_bandwidth=2.765e12,
            source=(
                "Google Cloud TPU v5p documentation, key specifications, "
                "https://cloud.google.com/tpu/docs/v5p; "
                + _JAX_PRECISION.format(how="one bfloat16 MXU pass")
            ),
            interconnect_bandwidth=100e9,
            interconnect_source="TPU v5p docs: " + _TPU_LINK.format(total=1200, ports=6),
        ),
    ),
    "v6e": Entry(
        "tpu",
        _tpu_memory("v6e", 32, "HBM"),
        Accelerator(
            name="TPU v6e",
            peak_flops=918e12,
            peak_flops_fp32=918e12,
            memory_bandwidth=1.638e12,
            source=(
                "Google Cloud TPU v6e documentation, key specifications, "
                "https://cloud.google.com/tpu/docs/v6e; "
                + _JAX_PRECISION.format(how="one bfloat16 MXU pass")
            ),
            interconnect_bandwidth=100e9,
            interconnect_source="TPU v6e docs: " + _TPU_LINK.format(total=800, ports=4),
        ),
    ),
}
# the links of the chips with an interconnect figure and a compile-only target
CATALOG["h100"] = CATALOG["h100"]._replace(links=_gpu_links(CATALOG["h100"].peaks, _DGX_H100))
for _gen in ("v5e", "v5p", "v6e"):
    CATALOG[_gen] = CATALOG[_gen]._replace(links=_tpu_links(CATALOG[_gen].peaks))

ACCELERATORS: dict[str, Accelerator] = {
    entry.peaks.name: entry.peaks for entry in CATALOG.values() if entry.peaks is not None
}


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def get_accelerator(accelerator: str | Accelerator) -> Accelerator:
    """An accelerator's peak figures.

    Args:
        accelerator: a name from `ACCELERATORS` (case, spaces and dashes ignored), or an
            `Accelerator`, returned as it is.

    Returns:
        The `Accelerator`.

    Raises:
        TypeError: neither a name nor an `Accelerator`.
        ValueError: a name the catalog does not hold.
    """
    if isinstance(accelerator, Accelerator):
        return accelerator
    if not isinstance(accelerator, str):
        raise TypeError(
            f"accelerator must be a name from jaxpipe.costs.ACCELERATORS or an Accelerator, "
            f"got {type(accelerator).__name__} {accelerator!r}"
        )
    for name, value in ACCELERATORS.items():
        if _key(name) == _key(accelerator):
            return value
    raise ValueError(
        f"unknown accelerator {accelerator!r}; known: {', '.join(ACCELERATORS)}. For another "
        "chip pass jaxpipe.costs.Accelerator(name, peak_flops, memory_bandwidth, source)"
    )
