"""Compile a training step ahead of time for a TPU topology or a GPU type, on any machine.

The accelerator's own compiler (libtpu, the CUDA plugin) runs here without the hardware:
``jax.experimental.topologies`` gives its devices, a ``Mesh`` is built on them, and a jitted
step lowered from ``jax.ShapeDtypeStruct``s with shardings compiles as it would on the chips.
`Report` reads what that compiler says, per device: argument, output and temporary bytes
against the chip's memory, the collectives by kind and mesh axis, and its time estimate;
per tick of a pipeline's loop, the collectives not behind computation and the time they take
over the links they cross (`Report.exposed`), and with an estimate of a tick's computation,
a predicted step time and model FLOP utilisation (`Report.step_time`).

```python
from jaxpipe import target
tpu = target.get("v5p:2x2x2")               # 8 TPU v5p chips; needs libtpu (see below)
mesh = tpu.mesh((4, 2), ("pipe", "data"))
report = tpu.compile(train_step, params, opt_state, batch)   # ShapeDtypeStructs on mesh
print(report)                                 # report.fits, report.headroom_bytes, ...
```

Targets: ``"v4:2x2x1"``, ``"v5e:2x2"``, ``"v5p:2x2x2"``, ``"v6e:4x4"`` (TPU generation and
chip topology, as Cloud TPU names them; needs ``pip install "jax[tpu]==<your jax version>"``),
``"h100"`` / ``"h100x8"`` (H100 SXM GPUs, 8 to a node; needs ``pip install
"jax-cuda12-plugin==<your jax version>"``) and ``"cpu"`` / ``"cpu:8"`` (this machine's host
devices, no capacity). Every number in a
report is per device: one SPMD program runs on every device of the mesh.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from jaxpipe.analysis import hlo
from jaxpipe.analysis.calibration import Calibration
from jaxpipe.analysis.hardware import CATALOG, DCN, Accelerator, Chip, GiB, Link, Links
from jaxpipe.analysis.hlo import KINDS, Collective, collectives


class TargetError(ValueError):
    """A target name that is not understood, or a compiler plugin that is not installed."""


class DoesNotFit(TargetError):
    """The target's compiler refused the program: it needs more memory than a device has.
    (The TPU compiler checks this itself; a `Report` says it for programs that compile.)"""


ADVICE = (
    "to make a step fit, hold less per device: more pipeline stages (a larger topology, "
    "--stages), weights and optimizer state split over an fsdp axis, more recomputation in "
    "the backward (remat), fewer rows per micro-batch (more micro-batches), bf16 compute; "
    "see the docs page 'Compile for a TPU ahead of time'"
)


CHIPS: dict[str, Chip] = {
    gen: entry.memory
    for gen, entry in CATALOG.items()
    if entry.platform == "tpu" and entry.memory is not None
}
GPUS: dict[str, tuple[Chip, str]] = {
    gpu: (entry.memory, entry.gpu_config)
    for gpu, entry in CATALOG.items()
    if entry.platform == "cuda" and entry.memory is not None and entry.gpu_config is not None
}
_GPU_NAME = re.compile(r"^(?P<gpu>" + "|".join(GPUS) + r")(?:x(?P<count>\d+))?$")
_TPU_NAME = re.compile(r"^(?P<gen>" + "|".join(CHIPS) + r"):(?P<shape>\d+(?:x\d+)+)$")
_CPU_NAME = re.compile(r"^cpu(?::(?P<count>\d+))?$")
_SLICES_NAME = re.compile(r"^(?P<slices>\d+)x(?P<slice>v\w+:\d+(?:x\d+)+)$")


@dataclasses.dataclass(frozen=True)
class Target:
    """Devices of a named target and the memory each device has.

    Attributes:
        name: as given to `get`, e.g. ``"v5p:2x2x2"``.
        platform: ``"tpu"``, ``"cuda"`` or ``"cpu"``.
        devices: the devices to build a ``Mesh`` on (not attached: compile only).
        chip: the chip and its memory, or None (CPU: no capacity to check against).
        devices_per_chip: devices that share one chip's memory (2 on v4, whose topology
            lists each TensorCore as a device; 1 elsewhere).
        links: the links between its devices (ICI; NVLink and the network; between TPU
            slices the data center network), or None.
        peaks: its chip's peak figures (FLOP/s, memory bandwidth), or None.
        slices: TPU slices joined by the data center network (``"2xv5p:4x4x8"``: 2).
    """

    name: str
    platform: str
    devices: tuple
    chip: Chip | None
    devices_per_chip: int = 1
    links: Links | None = None
    peaks: Accelerator | None = None
    slices: int = 1

    @property
    def nodes(self) -> int:
        """Groups of devices joined by the fast link (TPU slices, GPU nodes): 1 where every
        device shares it."""
        if self.links is None or self.links.across is None:
            return 1
        if self.links.by_slice:
            return self.slices
        return max(1, len(self.devices) // (self.links.devices_per_node or len(self.devices)))

    @property
    def memory_per_device(self) -> int | None:
        """Bytes of memory one device has: the chip's, shared by its devices."""
        return None if self.chip is None else self.chip.memory_bytes // self.devices_per_chip

    def mesh(
        self,
        shape: Sequence[int],
        axis_names: Sequence[str],
        across: str | Mapping[str, int] | None = None,
    ) -> jax.sharding.Mesh:
        """A mesh on the target's first ``prod(shape)`` devices, every axis automatic.

        Args:
            shape: the size of each axis.
            axis_names: the name of each axis.
            across: on a target of several slices or nodes (`nodes`), the axes whose groups
                span them: one axis name (its size a multiple of `nodes`; its groups span
                them all), or ``{axis: count}``, each axis's groups spanning ``count``
                nodes (a divisor of its size), the counts' product `nodes`. The other axes
                stay within a node. Default: the first axis whose size is a multiple of
                `nodes`.

        Returns:
            The ``Mesh``, its axes in ``axis_names``' order.

        Raises:
            TargetError: the target has fewer devices than the mesh needs, or ``across``
                cannot span its nodes.
        """
        shape, axis_names = tuple(shape), tuple(axis_names)
        needed = math.prod(shape)
        if needed > len(self.devices):
            raise TargetError(
                f"mesh {dict(zip(axis_names, shape, strict=True))} needs {needed} devices; "
                f"target {self.name!r} has {len(self.devices)}: pick a larger topology"
            )
        axis_types = (jax.sharding.AxisType.Auto,) * len(shape)
        nodes = self.nodes if needed == len(self.devices) else 1
        if nodes > 1:
            return self._mesh_across(shape, axis_names, across, nodes)
        try:
            return jax.make_mesh(
                shape, axis_names, axis_types=axis_types, devices=self.devices[:needed]
            )  # fmt: skip
        except NotImplementedError:  # an axis that splits a physical one (2 of 4x4x8's 4)
            from jax.experimental import mesh_utils

            devices = mesh_utils.create_device_mesh(
                shape, self.devices[:needed], allow_split_physical_axes=True
            )
            return jax.sharding.Mesh(devices, axis_names, axis_types=axis_types)

    def _mesh_across(self, shape, axis_names, across, nodes) -> jax.sharding.Mesh:
        """A mesh whose axes ``across`` span the target's nodes (slices or GPU nodes)."""
        sizes = dict(zip(axis_names, shape, strict=True))
        counts = node_counts(sizes, across, nodes)
        spans = tuple(counts.get(a, 1) for a in axis_names)
        within = tuple(sizes[a] // n for a, n in zip(axis_names, spans, strict=True))
        auto = (jax.sharding.AxisType.Auto,) * len(axis_names)
        if self.links.by_slice:  # TPU slices: a hybrid mesh, ICI within, DCN across
            from jax.experimental import mesh_utils

            grid = mesh_utils.create_hybrid_device_mesh(
                within, spans, self.devices, allow_split_physical_axes=True
            )
        else:
            grid = node_major_grid(within, spans, sorted(self.devices, key=self.links.node_of))
        return jax.sharding.Mesh(grid, axis_names, axis_types=auto)

    def compile(self, fn: Callable, *args, mesh=None, **kwargs) -> Report:
        """Compiles ``fn(*args, **kwargs)`` for this target and reports it.

        Args:
            fn: the step, ``jax.jit``-ed here unless it already is.
            *args: its arguments, ``jax.ShapeDtypeStruct``s with shardings on a mesh of
                this target.
            mesh: the mesh the report reads collectives against; by default the mesh of
                the first ``NamedSharding`` among the arguments.
            **kwargs: its keyword arguments, as ``args``.

        Returns:
            The `Report` of the compiled program.

        Raises:
            DoesNotFit: the target's compiler refused the program for lack of memory.
            TargetError: no mesh given and no argument with a ``NamedSharding``.
        """
        if mesh is None:
            mesh = _mesh_of((args, kwargs))
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
        start = time.perf_counter()
        lowered = jitted.lower(*args, **kwargs)
        try:
            compiled = lowered.compile()
        except Exception as error:
            text = str(error)
            if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
                raise
            raise DoesNotFit(
                f"target {self.name!r}: the step does NOT FIT one device's memory "
                f"({_size(self.memory_per_device)} by jaxpipe's table); the compiler says: "
                f"{text.strip().splitlines()[0]}\n{ADVICE}"
            ) from error
        return analyze(compiled, mesh, self, compile_seconds=time.perf_counter() - start)


def node_counts(sizes: Mapping[str, int], across, nodes: int) -> dict[str, int]:
    """How many nodes each axis's groups span, ``{axis: count}`` (only counts above 1).

    Args:
        sizes: the mesh's axis sizes.
        across: an axis name (its groups span all ``nodes``), ``{axis: count}``, or None
            (the first axis whose size is a multiple of ``nodes``).
        nodes: the nodes (slices, GPU nodes) the mesh spans.

    Raises:
        TargetError: an unknown axis, a count that does not divide its axis, or counts whose
            product is not ``nodes``.
    """
    if across is None:
        across = next((a for a, n in sizes.items() if n % nodes == 0), None)
    counts = {across: nodes} if isinstance(across, str) else dict(across or {})
    counts = {a: int(n) for a, n in counts.items() if n != 1}
    wrong = [a for a, n in counts.items() if a not in sizes or n < 1 or sizes[a] % n]
    if wrong or math.prod(counts.values()) != nodes:
        raise TargetError(
            f"{nodes} slices or nodes: the axes across them must split them exactly (each "
            f"count a divisor of its axis's size, their product {nodes}); mesh {dict(sizes)}, "
            f"across={across!r}. Pass an axis whose size is a multiple of {nodes}, or "
            "{axis: count, ...}"
        )
    return counts


def node_major_grid(within: Sequence[int], spans: Sequence[int], devices: Sequence) -> np.ndarray:
    """Devices (node by node, ``prod(within)`` a node) as a mesh grid whose axis ``i`` has
    ``spans[i] * within[i]`` devices: its groups hold devices of ``spans[i]`` nodes, the
    other axes' groups devices of one node."""
    grid = np.asarray(devices, dtype=object).reshape(*spans, *within)
    n = len(spans)
    order = [k for i in range(n) for k in (i, n + i)]  # each axis: its nodes, then within
    return grid.transpose(order).reshape([s * w for s, w in zip(spans, within, strict=True)])


def install_command(platform: str = "tpu") -> str:
    """The command that installs a compiler for the installed jax.

    Args:
        platform: ``"tpu"`` or ``"cuda"``.

    Returns:
        A ``pip install`` command line. For CUDA it installs the plugin alone: compiling
        needs none of the NVIDIA libraries that ``jax[cuda12]`` brings.
    """
    if platform == "cuda":
        return f'pip install "jax-cuda12-plugin=={jax.__version__}"'
    return f'pip install "jax[{platform}]=={jax.__version__}"'


def get(name: str) -> Target:
    """The compile-only target of a name.

    Args:
        name: ``"v5p:2x2x2"`` (a TPU generation of `CHIPS` and chip topology),
            ``"2xv5p:4x4x8"`` (that many slices of it, joined by the data center network),
            ``"h100"`` or ``"h100x8"`` (a GPU of `GPUS` and a count; 8 a node, nodes
            joined by their network cards), or ``"cpu"`` / ``"cpu:N"`` (N of this
            machine's host devices).

    Returns:
        The `Target`.

    Raises:
        TargetError: a name not understood, a compiler plugin not installed, or more CPU
            devices than this machine has.
    """
    cpu = _CPU_NAME.match(name)
    if cpu:
        devices = jax.devices("cpu")
        count = int(cpu.group("count") or len(devices))
        if count > len(devices):
            raise TargetError(
                f"target {name!r}: {len(devices)} CPU devices here; set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={count} before jax is imported"
            )
        return Target(name, "cpu", tuple(devices[:count]), None)
    gpu = _GPU_NAME.match(name)
    if gpu:
        return _gpu(name, gpu.group("gpu"), int(gpu.group("count") or 1))
    sliced = _SLICES_NAME.match(name)
    if sliced:
        return _slices(name, int(sliced.group("slices")), sliced.group("slice"))
    tpu = _TPU_NAME.match(name)
    if not tpu:
        raise TargetError(
            f"target {name!r} is not understood: give a TPU generation "
            f"({', '.join(CHIPS)}) and chip topology as Cloud TPU names them, such as "
            f"'v5p:2x2x2' or 'v5e:4x4'; a GPU ({', '.join(GPUS)}) and count, such as "
            "'h100x8'; or 'cpu' / 'cpu:8'"
        )
    if importlib.util.find_spec("libtpu") is None:
        raise TargetError(
            f"target {name!r} compiles with the TPU compiler (libtpu), which is not "
            f"installed: {install_command('tpu')}"
        )
    if not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/*"):
        # No TPU chip on this machine: let several processes load libtpu to compile (its
        # lockfile otherwise admits one process at a time, and compiling needs no chip),
        # and name this host as the only worker (libtpu otherwise logs an error that it
        # found none).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    from jax.experimental import topologies

    try:
        devices = topologies.get_topology_desc(topology_name=name, platform="tpu").devices
    except Exception as error:  # libtpu's own words: an unknown topology
        raise TargetError(f"libtpu does not know topology {name!r}: {error}") from error
    chips = {tuple(getattr(d, "coords", (d.id,))) for d in devices}
    entry = CATALOG[tpu.group("gen")]
    per_chip = len(devices) // len(chips)
    return Target(name, "tpu", tuple(devices), entry.memory, per_chip, entry.links, entry.peaks)


def _slices(name: str, slices: int, one: str) -> Target:
    """``slices`` TPU slices of topology ``one``, joined by the data center network."""
    first = get(one)
    gen = one.split(":")[0]
    if slices < 1:
        raise TargetError(f"target {name!r}: the number of slices must be at least 1")
    if gen not in DCN:
        raise TargetError(
            f"target {name!r}: jaxpipe has no published data center network figure for "
            f"{gen} (it has them for {sorted(DCN)})"
        )
    from jax.experimental import topologies

    try:
        devices = topologies.get_topology_desc(
            topology_name=one, platform="tpu", num_slices=slices
        ).devices
    except Exception as error:
        raise TargetError(f"libtpu cannot describe {slices} slices of {one!r}: {error}") from error
    per_slice = len(first.devices)
    links = Links(first.links.within, DCN[gen], per_slice, by_slice=True)
    return dataclasses.replace(first, name=name, devices=tuple(devices), links=links,
                               slices=slices)  # fmt: skip


def _gpu(name: str, gpu: str, count: int) -> Target:
    try:
        plugin = importlib.util.find_spec("jax_plugins.xla_cuda12")
    except ModuleNotFoundError:  # no jax_plugins package at all
        plugin = None
    if plugin is None:
        raise TargetError(
            f"target {name!r} compiles with the CUDA compiler (jax's CUDA plugin), which is "
            f"not installed: {install_command('cuda')}"
        )
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA libraries
    if not glob.glob("/dev/nvidia[0-9]*"):
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")  # no GPU: do not look for one
    from jax.experimental import topologies

    chip, config = GPUS[gpu]
    try:
        devices = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=f"1x1x{count}"
        ).devices
    except Exception as error:
        raise TargetError(f"the CUDA plugin cannot describe {name!r}: {error}") from error
    entry = CATALOG[gpu]
    return Target(name, "cuda", tuple(devices), chip, 1, entry.links, entry.peaks)


def _mesh_of(tree):
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    raise TargetError(
        "no argument has a NamedSharding: give the arguments as "
        "jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)), or pass mesh="
    )


def abstract(tree, shardings):
    """Shapes with shardings, to compile from.

    Args:
        tree: a pytree of arrays or shapes.
        shardings: a tree of shardings like ``tree``, or one sharding for every leaf.

    Returns:
        ``tree`` with each leaf a ``jax.ShapeDtypeStruct`` of its shape, dtype and sharding.
    """
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


# ----------------------------------------------------------------------------- the report
@dataclasses.dataclass(frozen=True)
class Report:
    """What the target's compiler says about one compiled program, per device.

    Attributes:
        target: the target's name; ``chip``: its chip, or None (no capacity known).
        mesh: axis name -> size.
        argument_bytes, output_bytes, alias_bytes, temp_bytes, code_bytes: from
            ``compiled.memory_analysis()`` (alias: outputs that reuse donated arguments).
        peak_bytes: ``peak_memory_in_bytes`` where the compiler reports it, else None.
        capacity_bytes: memory of one device (the chip's, shared by its devices), or None.
        collectives: every collective instruction (`Collective`).
        flops, bytes_accessed, optimal_seconds: ``compiled.cost_analysis()``, None where it
            gives none (``optimal_seconds``: the TPU compiler's own time estimate; on TPU a
            loop's body counts once, whatever its trip count).
        compile_seconds: how long lowering and compiling took here.
        links: the target's links (`Target.links`), or None; ``peaks``: its chip's peak
            figures, or None.
        links_of: the link each collective of ``collectives`` crosses (None: unknown).
        ticks: trip count of the program's outermost loop (a pipeline's tick loop,
            `hlo.outer_loop`), or None (no loop, or a count not printed).
        tick_runs: for each collective, how many times it runs in one tick where it is not
            behind computation (0 where it is, or not in the tick loop): of a conditional's
            branches (a device's possible actions) the heaviest in exposed time, inner
            loops their trip count times, of the loops of one trip or none that hold a
            device's backward actions off TPU the heaviest (`hlo.heaviest_runs`).
        step_runs: the same once per step outside the tick loop.
        uncounted_loops: the names of the loops whose trip count the report cannot read
            (`hlo.trip_count`) that hold a collective not behind computation, in the tick
            loop or outside it; `tick_runs` and `step_runs` count their bodies once, so
            their collectives may run more times than counted.

    A collective whose device groups are printed in a form the HLO reader does not know
    (`Collective.unread`) counts as one group of every device of the mesh, and the report
    names it (`unread_collectives`).
    """

    target: str
    chip: Chip | None
    mesh: dict
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    peak_bytes: int | None
    capacity_bytes: int | None
    collectives: tuple[Collective, ...]
    flops: float | None
    bytes_accessed: float | None
    optimal_seconds: float | None
    compile_seconds: float | None = None
    links: Links | None = None
    peaks: Accelerator | None = None
    links_of: tuple[Link | None, ...] = ()
    ticks: int | None = None
    tick_runs: tuple[int, ...] = ()
    step_runs: tuple[int, ...] = ()
    uncounted_loops: tuple[str, ...] = ()

    @property
    def unread_collectives(self) -> tuple[str, ...]:
        """The names of the collectives whose device groups the reader does not know
        (`Collective.unread`): each counted as one group of every device of the mesh."""
        return tuple(_name(c.line) for c in self.collectives if c.unread)

    def exposed(self, per: str = "tick") -> list[dict]:
        """The collectives not behind computation, grouped by (kind, mesh axes, link).

        Args:
            per: ``"tick"`` (`tick_runs`) or ``"step"`` (once per step outside the tick
                loop, `step_runs`).

        Returns:
            Dicts of ``kind``, ``axes``, ``link`` (its name, or None), ``count`` (runs),
            ``bytes`` (their results' bytes on one device), ``traffic`` (bytes one device
            sends, `Collective.traffic`) and ``seconds`` (traffic over the link's
            bandwidth; None with no link known).
        """
        if per not in ("tick", "step"):
            raise ValueError(f"per must be 'tick' or 'step', got {per!r}")
        runs = self.tick_runs if per == "tick" else self.step_runs
        groups: dict[tuple, dict] = {}
        for c, link, n in zip(self.collectives, self.links_of, runs, strict=True):
            if n == 0:
                continue
            name = None if link is None else link.name
            entry = groups.setdefault(
                (c.kind, c.axes, name),
                {"kind": c.kind, "axes": list(c.axes), "link": name, "count": 0, "bytes": 0,
                 "traffic": 0.0, "seconds": 0.0 if link else None},
            )  # fmt: skip
            entry["count"] += n
            entry["bytes"] += n * c.nbytes
            entry["traffic"] += n * c.traffic
            if link is not None:
                entry["seconds"] += n * c.traffic / link.bandwidth
        return sorted(groups.values(), key=lambda e: (KINDS.index(e["kind"]), e["axes"]))

    def exposed_seconds(self, per: str = "tick") -> float | None:
        """Seconds of the collectives of `exposed` (None with no link known)."""
        entries = self.exposed(per)
        if any(e["seconds"] is None for e in entries):
            return None
        return sum(e["seconds"] for e in entries)

    def step_time(
        self,
        tick_compute_seconds: float,
        compute_source: str,
        *,
        model_flops: float | None = None,
        flops_source: str = "",
        step_compute_seconds: float | None = None,
        step_compute_source: str | None = None,
        ticks: int | None = None,
        calibration: Calibration | None = None,
    ) -> StepTime:
        """A predicted step time: ticks x (compute + exposed communication per tick), plus
        the per-step part (exposed communication once a step, and its computation).

        Args:
            tick_compute_seconds: the estimated computation of one tick (for example the
                lock-step time of the table under the compiler's per-action estimates,
                divided by its ticks: `lockstep_tick_seconds`).
            compute_source: where ``tick_compute_seconds`` comes from, to print.
            model_flops: the model's FLOPs in one step on all devices, for the model FLOP
                utilisation, or None.
            flops_source: where ``model_flops`` comes from.
            step_compute_seconds: the computation once a step outside the tick loop; by
                default the step's arguments read and outputs written once at the chip's
                memory bandwidth (the optimizer update's least traffic), 0 with no figure.
            step_compute_source: where ``step_compute_seconds`` comes from.
            ticks: the schedule's ticks (``Schedule.num_ticks``); by default the tick
                loop's trip count. A compiler may run several ticks in one iteration of the
                loop (XLA's while-loop double buffering runs two, the odd one peeled off):
                given, the step counts ``ticks`` ticks, and the loop's exposed
                communication per iteration is spread over its ``ticks / trips`` ticks.
            calibration: a `jaxpipe.analysis.calibration.Calibration` (its ``get(platform)``)
                whose ``compute_scale`` multiplies the computation; None: the raw estimate.

        Returns:
            The `StepTime`.

        Raises:
            ValueError: a program with no tick loop whose trips are known, no link figure
                for the target, a negative time, or fewer ``ticks`` than the loop's trips.
        """
        if self.ticks is None:
            raise ValueError(
                "the program has no loop whose trip count the report reads (a pipeline's tick "
                "loop); a step time per tick needs one"
            )
        tick_exposed, step_exposed = self.exposed_seconds("tick"), self.exposed_seconds("step")
        if tick_exposed is None or step_exposed is None:
            raise ValueError(
                f"target {self.target!r} has no link bandwidth in jaxpipe.analysis.hardware; "
                "exposed communication has no time there"
            )
        if not tick_compute_seconds >= 0:
            raise ValueError(f"tick_compute_seconds must be >= 0, got {tick_compute_seconds!r}")
        if ticks is None:
            ticks = self.ticks
        if ticks < self.ticks:
            raise ValueError(
                f"ticks={ticks}: the tick loop runs {self.ticks} times, and each trip runs at "
                "least one tick; give the schedule's num_ticks"
            )
        if step_compute_seconds is None:
            if self.peaks is not None:
                traffic = self.argument_bytes + self.output_bytes
                step_compute_seconds = traffic / self.peaks.memory_bandwidth
                step_compute_source = (
                    f"arguments and outputs ({_size(traffic)}) once at the chip's memory "
                    f"bandwidth, {self.peaks.memory_bandwidth / 1e12:.3g} TB/s"
                )
            else:
                step_compute_seconds, step_compute_source = 0.0, "none estimated"
        peak = self.peaks.peak_flops if self.peaks is not None else None
        return StepTime(
            ticks=ticks,
            tick_compute_seconds=float(tick_compute_seconds),
            compute_source=compute_source,
            tick_exposed_seconds=tick_exposed
            if ticks == self.ticks
            else tick_exposed * self.ticks / ticks,
            trips=self.ticks,
            step_exposed_seconds=step_exposed,
            step_compute_seconds=float(step_compute_seconds),
            step_compute_source=step_compute_source or "",
            tick_exposed=tuple(self.exposed("tick")),
            step_exposed=tuple(self.exposed("step")),
            links=self.links,
            devices=math.prod(self.mesh.values()),
            model_flops=model_flops,
            flops_source=flops_source,
            peak_flops=peak,
            peak_source="" if self.peaks is None else self.peaks.source,
            uncounted_loops=self.uncounted_loops,
            unread_collectives=self.unread_collectives,
            calibration=calibration,
        )

    @property
    def needed_bytes(self) -> int:
        """What one device must hold while the step runs: the compiler's peak (arguments
        included) where it reports one, else arguments + outputs - aliased (donated) +
        temporaries + code (an upper bound: not all of it is live at once)."""
        if self.peak_bytes is not None:
            return self.peak_bytes
        return (
            self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
            + self.code_bytes
        )  # fmt: skip

    @property
    def fits(self) -> bool | None:
        """Whether `needed_bytes` fits the device's memory; None with no capacity known."""
        return None if self.capacity_bytes is None else self.needed_bytes <= self.capacity_bytes

    @property
    def headroom_bytes(self) -> int | None:
        """Capacity minus `needed_bytes` (negative: short by that much)."""
        return None if self.capacity_bytes is None else self.capacity_bytes - self.needed_bytes

    def collective_summary(self) -> list[dict]:
        """Collectives grouped by (kind, mesh axes, inside a loop or not): count, bytes, how
        many run behind a computation (`Collective.hidden`), and how many have device
        groups the reader does not know (`Collective.unread`)."""
        groups: dict[tuple, dict] = {}
        for c in self.collectives:
            key = (c.kind, c.axes, c.in_loop)
            entry = groups.setdefault(
                key,
                {
                    "kind": c.kind,
                    "axes": list(c.axes),
                    "in_loop": c.in_loop,
                    "count": 0,
                    "bytes": 0,
                    "hidden": 0,
                    "unread": 0,
                },
            )
            entry["count"] += 1
            entry["bytes"] += c.nbytes
            entry["hidden"] += bool(c.hidden)
            entry["unread"] += c.unread
        return sorted(
            groups.values(), key=lambda e: (KINDS.index(e["kind"]), e["axes"], e["in_loop"])
        )

    def as_dict(self) -> dict:
        """Everything in the report, JSON-ready (bytes as integers)."""
        per_collective = ("links_of", "tick_runs", "step_runs")  # as `exposed` groups them
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in per_collective
        }
        out["chip"] = None if self.chip is None else dataclasses.asdict(self.chip)
        out["links"] = None if self.links is None else dataclasses.asdict(self.links)
        out["peaks"] = None if self.peaks is None else dataclasses.asdict(self.peaks)
        out["collectives"] = self.collective_summary()
        out["unread_collectives"] = list(self.unread_collectives)
        out["exposed_per_tick"] = self.exposed("tick")
        out["exposed_per_step"] = self.exposed("step")
        out.update(
            needed_bytes=self.needed_bytes, fits=self.fits, headroom_bytes=self.headroom_bytes
        )
        return out

    def __str__(self) -> str:
        mesh = " x ".join(f"{n} {s}" for n, s in self.mesh.items())
        lines = [f"target {self.target}: mesh {mesh} ({math.prod(self.mesh.values())} devices)"]
        if self.compile_seconds is not None:
            lines[0] += f", compiled in {self.compile_seconds:.1f} s"
        lines.append("memory per device (every device runs the same program):")
        rows = [("arguments", self.argument_bytes), ("outputs", self.output_bytes),
                ("aliased (donated)", -self.alias_bytes), ("temporaries", self.temp_bytes),
                ("code", self.code_bytes)]  # fmt: skip
        if self.peak_bytes is not None:
            rows.append(("peak (compiler)", self.peak_bytes))
        lines += [f"  {label:<18} {_size(b):>12}" for label, b in rows]
        how = "the compiler's peak" if self.peak_bytes is not None else "the sum above"
        lines.append(f"  {'needed':<18} {_size(self.needed_bytes):>12}  ({how})")
        if self.capacity_bytes is None:
            lines.append("  capacity: unknown for this target (no fit check)")
        else:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(
                f"  capacity {_size(self.capacity_bytes)} ({self.chip.name}: {self.chip.source}"
                + (
                    ")"
                    if self.capacity_bytes == self.chip.memory_bytes
                    else ", shared by its devices)"
                )
            )
            share = self.headroom_bytes / self.capacity_bytes
            lines.append(f"  {verdict}: headroom {_size(self.headroom_bytes)} ({share:.0%} of it)")
        summary = self.collective_summary()
        lines.append("collectives (bytes per device per execution; in loop: once per iteration):")
        if not summary:
            lines.append("  none")
        for e in summary:
            axes = ",".join(e["axes"]) or "-"
            where = "in loop" if e["in_loop"] else "per step"
            count, size = f"x{e['count']}", _size(e["bytes"])
            behind = f"  {e['hidden']} behind computation" if e["hidden"] else ""
            unread = f"  {e['unread']} UNREAD" if e["unread"] else ""
            lines.append(
                f"  {e['kind']:<19} over {axes:<12} {where:<8} {count:>5} {size:>12}{behind}"
                f"{unread}"
            )
        if self.unread_collectives:
            lines.append(_unread_line(self.unread_collectives))
        if self.optimal_seconds is not None and self.optimal_seconds < 0:
            lines.append(f"compiler's time estimate: none (optimal_seconds is negative, "
                         f"{self.optimal_seconds:.3g})")  # fmt: skip
        elif self.optimal_seconds is not None:
            lines.append(f"compiler's time estimate (optimal_seconds, loop bodies counted "
                         f"once): {_seconds(self.optimal_seconds)}")  # fmt: skip
        if self.flops is not None:
            accessed = self.bytes_accessed or 0
            lines.append(f"cost_analysis: {self.flops:.3e} flops, {accessed:.3e} bytes accessed")
        return "\n".join(lines)


def _name(line: str) -> str:
    """The name of the instruction of ``line``."""
    return re.match(r"(?:ROOT\s+)?%?([\w.\-]+)", line).group(1)


def _unread_line(names) -> str:
    return (
        f"  UNREAD: {len(names)} collective(s) whose device groups the HLO reader does not "
        f"know, counted as one group of every device of the mesh (the most traffic, the "
        f"slowest link): {', '.join(names)}"
    )


def _seconds(seconds: float) -> str:
    for unit, scale in (("s", 1), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return "0 s" if seconds == 0 else f"{seconds:.3g} s"


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    sign, nbytes = ("-" if nbytes < 0 else ""), abs(nbytes)
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{sign}{nbytes / scale:.2f} {unit}"
    return f"{sign}{nbytes} B"


def analyze(compiled, mesh, target: Target | None = None, compile_seconds=None) -> Report:
    """What the compiler says about a compiled program.

    Args:
        compiled: ``jax.jit(f).lower(...).compile()``.
        mesh: the mesh it runs on (to read the collectives' axes).
        target: the `Target` it was compiled for (its chip's capacity), or None.
        compile_seconds: how long compiling took, to report.

    Returns:
        The `Report`.
    """
    memory = compiled.memory_analysis()
    text = compiled.as_text() or ""
    found = tuple(collectives(text, mesh))
    links = target.links if target else None
    devices = list(mesh.devices.flat)
    links_of = tuple(None if links is None else links.of_groups(c.groups, devices) for c in found)
    ticks, tick_runs, step_runs, uncounted = _runs(text, found, links_of)
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # one dict per computation
        cost = cost[0] if cost else {}
    cost = cost or {}
    peak = getattr(memory, "peak_memory_in_bytes", None)
    return Report(
        target=target.name if target else mesh.devices.flat[0].platform,
        chip=target.chip if target else None,
        mesh=dict(mesh.shape),
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes),
        peak_bytes=int(peak) if peak else None,
        capacity_bytes=target.memory_per_device if target else None,
        collectives=found,
        flops=cost.get("flops"),
        bytes_accessed=cost.get("bytes accessed"),
        optimal_seconds=cost.get("optimal_seconds"),
        compile_seconds=compile_seconds,
        links=links,
        peaks=target.peaks if target else None,
        links_of=links_of,
        ticks=ticks,
        tick_runs=tick_runs,
        step_runs=step_runs,
        uncounted_loops=uncounted,
    )


def _runs(text: str, found, links_of) -> tuple:
    """(trip count of the tick loop, each collective's runs per tick and per step where
    it is not behind computation, the loops of unknown trip count holding such a
    collective): `Report.tick_runs`, `Report.uncounted_loops`."""
    comps, entry = hlo.computations(text)
    where = {(c.computation, c.index): (c, link) for c, link in zip(found, links_of, strict=True)}

    def weight(name, index, _line):
        c, link = where.get((name, index), (None, None))
        if c is None or c.hidden:
            return 0.0
        return max(c.traffic, 1e-9) / (link.bandwidth if link else 1.0)

    loop = hlo.outer_loop(comps)
    ticks = None if loop is None else hlo.trip_count(loop, comps)
    per_tick: dict = {}
    uncounted = [] if entry is None else hlo.uncounted_loops(comps, entry, weight, skip=loop)
    if loop is not None:
        body = hlo.called(loop, ("body",))[0]
        per_tick = hlo.heaviest_runs(comps, body, weight)[1]
        uncounted += [u for u in hlo.uncounted_loops(comps, body, weight) if u not in uncounted]
    per_step = {} if entry is None else hlo.heaviest_runs(comps, entry, weight, skip=loop)[1]
    keys = [(c.computation, c.index) for c in found]
    names = tuple(_name(u) for u in uncounted)
    return (
        ticks,
        tuple(per_tick.get(k, 0) for k in keys),
        tuple(per_step.get(k, 0) for k in keys),
        names,
    )


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A predicted step time and model FLOP utilisation, from a `Report` (`Report.step_time`).

    Every figure is an estimate: the computation from what the caller gives (the compiler's
    per-action estimates, say), the communication from the bytes of the collectives the
    compiler did not schedule behind a computation, at the bandwidth of the link they
    cross (a collective scheduled behind a computation counts as hidden whole).

    Attributes:
        ticks: the schedule's ticks (`Report.step_time`'s ``ticks``: by default the tick
            loop's trips).
        tick_compute_seconds, compute_source: one tick's computation and its source.
        tick_exposed_seconds, step_exposed_seconds: exposed communication per tick, and
            once per step outside the tick loop.
        step_compute_seconds, step_compute_source: the computation once per step.
        tick_exposed, step_exposed: `Report.exposed` per tick and per step.
        links: the links whose bandwidths are used.
        devices: devices of the mesh.
        model_flops, flops_source: the model's FLOPs per step (all devices), or None.
        peak_flops, peak_source: one chip's peak FLOP/s (bf16, dense), or None.
        uncounted_loops: `Report.uncounted_loops`: loops of unknown trip count holding
            exposed collectives, counted once each (the exposed time may be too low).
        trips: iterations of the tick loop (``ticks`` unless the compiler runs several
            ticks per iteration; then the listed ``tick_exposed`` are per iteration).
        unread_collectives: `Report.unread_collectives`: collectives whose device groups
            are not read, counted as one group of every device.
        calibration: the `Calibration` whose ``compute_scale`` multiplies the computation
            (``tick_compute_seconds`` and ``step_compute_seconds`` stay the raw estimates),
            or None: every figure is the raw estimate.
    """

    ticks: int
    tick_compute_seconds: float
    compute_source: str
    tick_exposed_seconds: float
    step_exposed_seconds: float
    step_compute_seconds: float
    step_compute_source: str
    tick_exposed: tuple
    step_exposed: tuple
    links: Links | None
    devices: int
    model_flops: float | None = None
    flops_source: str = ""
    peak_flops: float | None = None
    peak_source: str = ""
    uncounted_loops: tuple[str, ...] = ()
    trips: int | None = None
    unread_collectives: tuple[str, ...] = ()
    calibration: Calibration | None = None

    @property
    def compute_scale(self) -> float:
        """What the computation's estimate is multiplied by: the calibration's, else 1."""
        return 1.0 if self.calibration is None else self.calibration.compute_scale

    @property
    def tick_seconds(self) -> float:
        """One tick: its computation (x `compute_scale`) plus its exposed communication."""
        return self.compute_scale * self.tick_compute_seconds + self.tick_exposed_seconds

    @property
    def per_step_seconds(self) -> float:
        """The part outside the tick loop: computation (x `compute_scale`) plus exposed
        communication."""
        return self.compute_scale * self.step_compute_seconds + self.step_exposed_seconds

    @property
    def step_seconds(self) -> float:
        """``ticks x tick_seconds + per_step_seconds``."""
        return self.ticks * self.tick_seconds + self.per_step_seconds

    @property
    def mfu(self) -> float | None:
        """Model FLOP utilisation: model FLOPs / (devices x peak x step time), or None."""
        if self.model_flops is None or self.peak_flops is None or self.step_seconds <= 0:
            return None
        return self.model_flops / (self.devices * self.peak_flops * self.step_seconds)

    def as_dict(self) -> dict:
        """Every figure, JSON-ready."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["links"] = None if self.links is None else dataclasses.asdict(self.links)
        out["tick_exposed"], out["step_exposed"] = list(self.tick_exposed), list(self.step_exposed)
        out["uncounted_loops"] = list(self.uncounted_loops)
        out["unread_collectives"] = list(self.unread_collectives)
        out["calibration"] = (
            None if self.calibration is None else dataclasses.asdict(self.calibration)
        )
        out.update(tick_seconds=self.tick_seconds, per_step_seconds=self.per_step_seconds,
                   step_seconds=self.step_seconds, mfu=self.mfu,
                   compute_scale=self.compute_scale)  # fmt: skip
        return out

    def __str__(self) -> str:
        kind = "raw compiler estimates" if self.calibration is None else "calibrated"
        lines = [f"predicted step time ({kind}; exposed: collectives not behind computation):"]
        if self.uncounted_loops:
            lines.append(
                f"  UNDERCOUNTED: {len(self.uncounted_loops)} loop(s) whose trip count is not "
                f"read hold exposed collectives, counted once per run: "
                f"{', '.join(self.uncounted_loops)}; the exposed time may be too low"
            )
        if self.unread_collectives:
            lines.append(_unread_line(self.unread_collectives))
        lines.append(f"  per tick, computation {_seconds(self.tick_compute_seconds):>9}  "
                     f"({self.compute_source})")  # fmt: skip
        trip_total = sum(e["seconds"] for e in self.tick_exposed)  # one trip's, as listed
        lines += _exposed_lines(self.tick_exposed, trip_total)
        if self.trips is not None and self.trips != self.ticks:
            lines.append(f"    (its {self.ticks} ticks run in {self.trips} trips of the "
                         "loop: the collectives above are one trip's)")  # fmt: skip
        lines.append(f"  per tick, exposed     {_seconds(self.tick_exposed_seconds):>9}")
        lines.append(
            f"  per step outside the tick loop, exposed {_seconds(self.step_exposed_seconds)}"
            f", computation {_seconds(self.step_compute_seconds)} ({self.step_compute_source})"
        )
        lines += _exposed_lines(self.step_exposed, self.step_exposed_seconds)
        if self.calibration is not None:
            c = self.calibration
            lines.append(
                f"  calibrated: computation x{c.compute_scale:.3f}, {c.source} (a run held "
                f"out of the fit was predicted within {c.held_out_error:.0%}); exposed "
                "communication as read, not calibrated (it read high on a published run)"
            )
        lines.append(
            f"  step: {self.ticks} ticks x {_seconds(self.tick_seconds)} + "
            f"{_seconds(self.per_step_seconds)} = {_seconds(self.step_seconds)}"
        )
        if self.mfu is not None:
            lines.append(f"  model FLOP utilisation {self.mfu:.1%}: {self.model_flops:.3e} "
                         f"FLOPs ({self.flops_source}) / ({self.devices} x "
                         f"{self.peak_flops / 1e12:.4g} TFLOP/s x step)")  # fmt: skip
        if self.peak_flops is not None:
            lines.append(f"  peak {self.peak_flops / 1e12:.4g} TFLOP/s: {self.peak_source}")
        if self.links is not None:
            for link in (self.links.within, self.links.across):
                if link is not None:
                    lines.append(f"  {link.name} {link.bandwidth / 1e9:.3g} GB/s: {link.source}")
        return "\n".join(lines)


def _exposed_lines(entries, total: float) -> list[str]:
    """A line per group of exposed collectives; those under 1% of ``total`` in one line."""
    lines, small = [], [e for e in entries if e["seconds"] < 0.01 * total]
    for e in entries:
        if e in small:
            continue
        axes = ",".join(e["axes"]) or "-"
        lines.append(f"    {e['kind']:<19} over {axes:<12} x{e['count']:<4} "
                     f"{_size(e['bytes']):>11}  {e['link']} {_seconds(e['seconds'])}")  # fmt: skip
    if small:
        seconds = sum(e["seconds"] for e in small)
        lines.append(f"    and {sum(e['count'] for e in small)} smaller ones "
                     f"({_size(sum(e['bytes'] for e in small))}, {_seconds(seconds)})")  # fmt: skip
    return lines


def lockstep_tick_seconds(schedule, costs) -> float:
    """The mean computation of one tick of ``schedule`` run in lock-step under ``costs``
    (without sends or all-to-alls, which the report reads from the program as exposed
    communication): its lock-step time (`jaxpipe.schedules.simulate`) over its ticks.

    Args:
        schedule: a `jaxpipe.schedules.Schedule`.
        costs: `jaxpipe.schedules.Costs` in seconds (`jaxpipe.costs.compiler_seconds`).

    Returns:
        Seconds.
    """
    from jaxpipe.schedules import simulate

    quiet = dataclasses.replace(
        costs,
        communication=0.0,
        all_to_all_forward=0.0,
        all_to_all_backward=0.0,
        all_to_all_weight=0.0,
    )
    return simulate(schedule, quiet, "lockstep").makespan / schedule.num_ticks
