"""Multi-process helpers: start JAX's multi-controller runtime and feed global arrays.

Under ``jax.distributed`` every process runs the same program on a mesh that spans all
processes' devices; a `Pipeline` built on such a mesh runs unchanged (its pipe axis may cross
process boundaries). What changes is how arrays are made: each process only holds the
shards of its own devices. These helpers build those arrays from host data::

    from jaxpipe import distributed
    distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=rank)
    mesh = jax.make_mesh((2, 2), ("pipe", "data"), devices=jax.devices())
    stage_params = distributed.global_array(stage_params_np, mesh, P("pipe"))
    inputs = distributed.batch_from_global(global_inputs_np, mesh, P("data"))
    # or, when each process only has its own rows:
    inputs = distributed.batch_from_local(local_inputs_np, mesh, P("data"), global_batch)

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

    ``cpu_collectives`` (``"gloo"`` or ``"mpi"``) sets ``jax_cpu_collectives_implementation``
    first, so that CPU devices of different processes can exchange data (needed to test
    multi-host code on one machine); it has no effect on GPU or TPU devices.
    ``heartbeat_timeout_seconds``: a process that stops sending heartbeats for this long is
    declared dead and the coordination service terminates every other process with an
    error, so a crashed peer ends the run instead of hanging it. Must be called before any
    other JAX call, in every process.
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
    """A global ``jax.Array`` of ``value`` (the same full host array in every process),
    sharded by ``spec``; each process only copies the shards of its own devices."""
    value = np.asarray(value)
    sharding = _sharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def global_tree(tree, mesh: jax.sharding.Mesh, spec: P | Sequence = ()):
    """`global_array` on every leaf of ``tree`` (one ``spec`` for all leaves)."""
    return jax.tree_util.tree_map(lambda x: global_array(x, mesh, spec), tree)


def local_rows(mesh: jax.sharding.Mesh, spec: P | Sequence, global_shape: Sequence[int]) -> slice:
    """The rows (axis 0) of a ``global_shape`` array that this process's devices hold.

    ``spec`` must shard axis 0 so that each process holds one contiguous block of rows (the
    usual ``P("data")`` with the data axis laid out process by process), or replicate it.
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
    """A global batch of ``global_batch`` rows from this process's own rows ``local_data``
    (see `local_rows` for which rows those are); wraps
    ``jax.make_array_from_process_local_data``."""
    local_data = np.asarray(local_data)
    global_shape = (global_batch, *local_data.shape[1:])
    return jax.make_array_from_process_local_data(_sharding(mesh, spec), local_data, global_shape)


def batch_from_global(global_data, mesh: jax.sharding.Mesh, spec: P | Sequence) -> jax.Array:
    """A global batch from the full host batch that every process has: each process feeds
    only its own rows (`local_rows`) through `batch_from_local`."""
    global_data = np.asarray(global_data)
    rows = local_rows(mesh, spec, global_data.shape)
    return batch_from_local(global_data[rows], mesh, spec, global_data.shape[0])
