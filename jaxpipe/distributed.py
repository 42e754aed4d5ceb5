"""Multi-process helpers: start JAX's multi-controller runtime and feed global arrays.

Under ``jax.distributed`` every process runs the same program on a mesh that spans all
processes' devices; a `Pipeline` built on such a mesh runs unchanged (its pipe axis may cross
process boundaries). What changes is how arrays are made: each process only holds the
shards of its own devices. These helpers build those arrays from host data::

    import jaxpipe
    jaxpipe.distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=rank)
    mesh = jax.make_mesh((2, 2), ("pipe", "data"), devices=jax.devices())
    stage_params = jaxpipe.distributed.global_array(stage_params_np, mesh, P("pipe"))
    inputs = jaxpipe.distributed.batch_from_global(global_inputs_np, mesh, P("data"))
    # or, when each process only has its own rows:
    inputs = jaxpipe.distributed.batch_from_local(local_inputs_np, mesh, P("data"), batch)

Every process must call these with the same arguments (the same global data, or its own
rows of it), in the same order, as with any multi-controller JAX program.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    heartbeat_timeout_seconds: int = 100,
    initialization_timeout: int = 300,
    cpu_collectives: str | None = "gloo",
) -> None:
    """``jax.distributed.initialize`` with the settings a pipeline run needs.

    Call it before any other JAX call, in every process.

    Args:
        coordinator_address: ``host:port`` of process 0's coordination service.
        num_processes: the number of processes.
        process_id: this process's index, ``0 .. num_processes - 1``.
        heartbeat_timeout_seconds: a process that stops sending heartbeats for this long is
            declared dead and the coordination service ends every other process with an
            error, so a crashed peer ends the run instead of hanging it.
        initialization_timeout: seconds to wait for every process to connect.
        cpu_collectives: ``"gloo"`` or ``"mpi"`` sets ``jax_cpu_collectives_implementation``
            first, so that CPU devices of different processes can exchange data (to test
            multi-host code on one machine); no effect on GPU or TPU devices. ``None``
            leaves the setting alone.
    """
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        initialization_timeout=initialization_timeout,
    )


def _sharding(mesh: jax.sharding.Mesh, spec) -> NamedSharding:
    return NamedSharding(mesh, spec if isinstance(spec, P) else P(*spec))


def global_array(value, mesh: jax.sharding.Mesh, spec: P | Sequence = ()) -> jax.Array:
    """A global ``jax.Array`` from a host array that every process holds in full.

    Args:
        value: the same full host array in every process.
        mesh: the global mesh.
        spec: a ``PartitionSpec`` (or a sequence of its entries) over ``mesh``.

    Returns:
        ``value`` as a ``jax.Array`` sharded by ``spec``; each process copies only the
        shards of its own devices.
    """
    value = np.asarray(value)
    sharding = _sharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def global_tree(tree, mesh: jax.sharding.Mesh, spec: P | Sequence = ()):
    """`global_array` on every leaf of ``tree``.

    Args:
        tree: a pytree of host arrays, the same in every process.
        mesh: the global mesh.
        spec: one ``PartitionSpec`` for all leaves.

    Returns:
        ``tree`` with every leaf a global ``jax.Array``.
    """
    return jax.tree_util.tree_map(lambda x: global_array(x, mesh, spec), tree)


def local_rows(mesh: jax.sharding.Mesh, spec: P | Sequence, global_shape: Sequence[int]) -> slice:
    """The rows (axis 0) of a ``global_shape`` array that this process's devices hold.

    Args:
        mesh: the global mesh.
        spec: a ``PartitionSpec`` that shards axis 0 so that each process holds one
            contiguous block of rows (the usual ``P("data")`` with the data axis laid out
            process by process), or replicates it.
        global_shape: the shape of the global array.

    Returns:
        A ``slice`` of axis 0.

    Raises:
        ValueError: this process's rows are not one contiguous block.
    """
    sharding = _sharding(mesh, spec)
    index_map = sharding.addressable_devices_indices_map(tuple(global_shape))
    starts, stops = [], []
    for index in index_map.values():
        start, stop, _ = index[0].indices(global_shape[0]) if index else (0, global_shape[0], 1)
        starts.append(start)
        stops.append(stop)
    rows = slice(min(starts), max(stops))
    held = {r for start, stop in zip(starts, stops, strict=True) for r in range(start, stop)}
    if len(held) != rows.stop - rows.start:
        raise ValueError(
            f"this process holds rows {sorted(held)} of axis 0 under {spec}, not one "
            "contiguous block; lay the mesh out so that each process owns a contiguous "
            "range of the batch-sharding axis"
        )
    return rows


def batch_from_local(
    local_data, mesh: jax.sharding.Mesh, spec: P | Sequence, global_batch: int
) -> jax.Array:
    """A global batch from the rows this process holds (``jax.make_array_from_process_local_data``).

    Args:
        local_data: this process's own rows of the batch (`local_rows` says which).
        mesh: the global mesh.
        spec: the ``PartitionSpec`` of the batch over ``mesh``.
        global_batch: the number of rows of the whole batch.

    Returns:
        A global ``jax.Array`` of ``global_batch`` rows.
    """
    local_data = np.asarray(local_data)
    global_shape = (global_batch, *local_data.shape[1:])
    return jax.make_array_from_process_local_data(_sharding(mesh, spec), local_data, global_shape)


def batch_from_global(global_data, mesh: jax.sharding.Mesh, spec: P | Sequence) -> jax.Array:
    """A global batch from the full host batch that every process holds.

    Each process feeds only its own rows (`local_rows`) through `batch_from_local`.

    Args:
        global_data: the whole batch, the same in every process.
        mesh: the global mesh.
        spec: the ``PartitionSpec`` of the batch over ``mesh``.

    Returns:
        A global ``jax.Array`` of ``global_data``'s shape.

    Raises:
        ValueError: this process's rows are not one contiguous block.
    """
    global_data = np.asarray(global_data)
    rows = local_rows(mesh, spec, global_data.shape)
    return batch_from_local(global_data[rows], mesh, spec, global_data.shape[0])
