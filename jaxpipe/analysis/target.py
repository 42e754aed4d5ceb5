"""Compile a training step ahead of time for a TPU topology or a GPU type, on any machine.

The accelerator's own compiler (libtpu, the CUDA plugin) runs here without the hardware:
``jax.experimental.topologies`` gives its devices, a ``Mesh`` is built on them, and a jitted
step lowered from ``jax.ShapeDtypeStruct``s with shardings compiles as it would on the chips.
`Report` reads what that compiler says, per device: argument, output and temporary bytes
against the chip's memory, the collectives by kind and mesh axis, and its time estimate.

```python
from jaxpipe import target
tpu = target.get("v5p:2x2x2")               # 8 TPU v5p chips; needs libtpu (see below)
mesh = tpu.mesh((4, 2), ("pipe", "data"))
report = tpu.compile(train_step, params, opt_state, batch)   # ShapeDtypeStructs on mesh
print(report)                                 # report.fits, report.headroom_bytes, ...
```

Targets: ``"v4:2x2x1"``, ``"v5e:2x2"``, ``"v5p:2x2x2"``, ``"v6e:4x4"`` (TPU generation and
chip topology, as Cloud TPU names them; needs ``pip install "jax[tpu]==<your jax version>"``),
``"h100"`` / ``"h100x8"`` (H100 SXM GPUs of one node; needs ``pip install
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
from collections.abc import Callable, Sequence

import jax

from jaxpipe.analysis.hardware import CATALOG, Chip, GiB
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
    """

    name: str
    platform: str
    devices: tuple
    chip: Chip | None
    devices_per_chip: int = 1

    @property
    def memory_per_device(self) -> int | None:
        """Bytes of memory one device has: the chip's, shared by its devices."""
        return None if self.chip is None else self.chip.memory_bytes // self.devices_per_chip

    def mesh(self, shape: Sequence[int], axis_names: Sequence[str]) -> jax.sharding.Mesh:
        """A mesh on the target's first ``prod(shape)`` devices, every axis automatic.

        Args:
            shape: the size of each axis.
            axis_names: the name of each axis.

        Returns:
            The ``Mesh``.

        Raises:
            TargetError: the target has fewer devices than the mesh needs.
        """
        needed = math.prod(shape)
        if needed > len(self.devices):
            raise TargetError(
                f"mesh {dict(zip(axis_names, shape, strict=True))} needs {needed} devices; "
                f"target {self.name!r} has {len(self.devices)}: pick a larger topology"
            )
        return jax.make_mesh(
            tuple(shape),
            tuple(axis_names),
            axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
            devices=self.devices[:needed],
        )

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
        name: ``"v5p:2x2x2"`` (a TPU generation of `CHIPS` and chip topology), ``"h100"``
            or ``"h100x8"`` (a GPU of `GPUS` and a count), or ``"cpu"`` / ``"cpu:N"`` (N of
            this machine's host devices).

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
    return Target(name, "tpu", tuple(devices), CHIPS[tpu.group("gen")], len(devices) // len(chips))


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
    return Target(name, "cuda", tuple(devices), chip)


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
        """Collectives grouped by (kind, mesh axes, inside a loop or not): count, bytes, and
        how many run behind a computation (`Collective.hidden`)."""
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
                },
            )
            entry["count"] += 1
            entry["bytes"] += c.nbytes
            entry["hidden"] += bool(c.hidden)
        return sorted(
            groups.values(), key=lambda e: (KINDS.index(e["kind"]), e["axes"], e["in_loop"])
        )

    def as_dict(self) -> dict:
        """Everything in the report, JSON-ready (bytes as integers)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["chip"] = None if self.chip is None else dataclasses.asdict(self.chip)
        out["collectives"] = self.collective_summary()
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
            lines.append(
                f"  {e['kind']:<19} over {axes:<12} {where:<8} {count:>5} {size:>12}{behind}"
            )
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


def _seconds(seconds: float) -> str:
    for unit, scale in (("s", 1), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds:.3g} s"


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
        collectives=tuple(collectives(compiled.as_text() or "", mesh)),
        flops=cost.get("flops"),
        bytes_accessed=cost.get("bytes accessed"),
        optimal_seconds=cost.get("optimal_seconds"),
        compile_seconds=compile_seconds,
    )
