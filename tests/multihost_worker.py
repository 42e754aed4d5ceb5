"""A training run of the residual MLP through a `Pipeline`, shared by the multi-process,
checkpoint and determinism tests; run as a script it is one process of such a test.

    python multihost_worker.py train  --process-id I --num-processes N --port P --out F
    python multihost_worker.py die    --process-id I --num-processes N --port P --out F
    python multihost_worker.py resume --checkpoint DIR --out F

- ``train``: under ``jax.distributed`` (gloo CPU collectives), each configuration of
  `CONFIGS` named by ``--configs`` (default: all) trains `STEPS` steps; the losses go to
  ``--out`` as JSON.
- ``die``: like ``train``, but process 1 exits abruptly (``os._exit``) after the first step;
  the others must then fail within the heartbeat timeout instead of hanging.
- ``resume``: one process: restores the latest checkpoint in ``--checkpoint``, trains up to
  step `RESUME_STEPS`, writes the final state to ``--out`` (``.npz``).

Data and initial parameters depend only on seeds, so every process (and the test process)
builds the same global values and feeds its own shards of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

# name: (mesh shape, axis names, schedule, options). Process p owns devices 2p and 2p + 1:
# in "pipe4" the pipe axis crosses the process boundary (stages 0-1 | 2-3); in
# "pipe2_data2" each process holds one whole pipe (devices laid out data-major) and feeds
# its own half of every batch.
CONFIGS = {
    "pipe4": ((4,), ("pipe",), "1f1b", {}),
    "pipe2_data2": ((2, 2), ("pipe", "data"), "1f1b", {}),
}
STEPS = 5
RESUME_STEPS = 6
NUM_MICROBATCHES = 4
BATCH = 16
NUM_LOGICAL_STAGES = 4
HEARTBEAT_TIMEOUT_S = 5


def initial_state(num_logical_stages=NUM_LOGICAL_STAGES, seed=0, width=None):
    """Host (numpy) stage and loss parameters, the same in every process."""
    import jax
    import models

    kwargs = {} if width is None else {"width": width}
    stage_params, loss_params = models.init(jax.random.key(seed), num_logical_stages, **kwargs)
    to_numpy = lambda t: jax.tree_util.tree_map(np.asarray, t)  # noqa: E731
    return to_numpy(stage_params), to_numpy(loss_params)


def batch(step, batch_size=BATCH, seed=1, width=None):
    """Host inputs and targets of training step ``step`` (fresh random values each step)."""
    import models

    rng = np.random.default_rng([seed, step])
    width = models.WIDTH if width is None else width
    inputs = rng.standard_normal((batch_size, width), dtype=np.float32)
    targets = rng.standard_normal((batch_size, models.OUT), dtype=np.float32)
    return inputs, targets


def make_mesh(shape, names, devices=None):
    """A mesh over the first devices (default ``jax.devices()``, process by process). For
    ``("pipe", "data")`` consecutive devices go along ``pipe``: one process's devices form
    one whole pipe and the processes split the data."""
    import jax

    count = int(np.prod(shape))
    devices = np.asarray(jax.devices()[:count] if devices is None else devices)
    if tuple(names) == ("pipe", "data"):
        devices = devices.reshape(shape[1], shape[0]).T
    return jax.sharding.Mesh(
        devices.reshape(shape), names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape)
    )


def make_pipeline(mesh, schedule="1f1b", options=None, num_microbatches=NUM_MICROBATCHES):
    import models

    from jaxpipe import pipeline

    return pipeline.Pipeline(
        models.stage_fn,
        models.loss_fn,
        mesh=mesh,
        schedule=schedule,
        num_microbatches=num_microbatches,
        schedule_options=options or {},
    )


def optimizer():
    import optax

    return optax.adam(1e-2)


def make_train_step(pipe):
    """A jitted ``(state, inputs, targets) -> (state, loss)``; ``state`` holds
    ``params = (stage_params, loss_params)`` and the Adam state ``opt``."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    opt = optimizer()

    def step(state, inputs, targets):
        def loss(params):
            return pipe.loss(params[0], params[1], inputs, targets)

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        value = jax.lax.with_sharding_constraint(value, NamedSharding(pipe.mesh, P()))
        return {"params": params, "opt": opt_state}, value

    return jax.jit(step)


def shard_state(pipe, stage_params, loss_params):
    """Global arrays: stage parameters placed in the pipeline's layout (each device copies
    its own stages from the host values), loss parameters replicated; plus the optimizer
    state (its stage-shaped leaves sharded like the parameters)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpipe import distributed

    params = (pipe.place(stage_params), distributed.global_tree(loss_params, pipe.mesh, ()))
    replicated = NamedSharding(pipe.mesh, P())
    layout = pipe.layout

    def init(params):  # moments of stage parameters in the layout; the rest replicated
        state = optimizer().init(params)

        def constrain(x):
            stage = x.shape[:2] == layout.stage_at.shape
            return jax.lax.with_sharding_constraint(x, layout.sharding() if stage else replicated)

        return jax.tree_util.tree_map(constrain, state)

    return {"params": params, "opt": jax.jit(init)(params)}


def batch_spec(mesh):
    return ("data",) if "data" in mesh.shape else ()


def train(mesh, schedule, options, steps, state=None, first_step=0):
    """``steps`` training steps from ``state`` (default: the seeded initial state) starting
    at step index ``first_step``; returns ``(state, losses)``."""
    from jaxpipe import distributed

    pipe = make_pipeline(mesh, schedule, options)
    if state is None:
        state = shard_state(pipe, *initial_state(pipe.num_logical_stages))
    step_fn = make_train_step(pipe)
    spec = batch_spec(mesh)
    losses = []
    for i in range(first_step, first_step + steps):
        inputs, targets = batch(i)
        inputs = distributed.batch_from_global(inputs, mesh, spec)
        targets = distributed.batch_from_global(targets, mesh, spec)
        state, loss = step_fn(state, inputs, targets)
        losses.append(float(np.asarray(loss.addressable_data(0))))
    return state, losses


def host_tree(tree):
    """Every leaf as a numpy array (leaves must be fully addressable)."""
    import jax

    return jax.tree_util.tree_map(np.asarray, tree)


def _die(shape, names, schedule, options):
    """Trains until process 1 exits abruptly before step 1; the others must not survive."""
    import jax

    from jaxpipe import distributed

    mesh = make_mesh(shape, names)
    pipe = make_pipeline(mesh, schedule, options)
    state = shard_state(pipe, *initial_state(pipe.num_logical_stages))
    step_fn = make_train_step(pipe)
    for i in range(1000):
        if i == 1 and jax.process_index() == 1:
            print("process 1 exits abruptly", flush=True)
            os._exit(3)
        inputs, targets = (distributed.batch_from_global(a, mesh, ()) for a in batch(i))
        state, loss = step_fn(state, inputs, targets)
        print(f"step {i} loss {float(np.asarray(loss.addressable_data(0)))}", flush=True)
    raise AssertionError("process 0 kept training after its peer died")


def _main_multiprocess(args):
    from jaxpipe import distributed

    distributed.initialize(
        f"127.0.0.1:{args.port}",
        args.num_processes,
        args.process_id,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        initialization_timeout=60,
    )
    import jax

    assert jax.process_count() == args.num_processes, jax.process_count()
    if args.mode == "die":
        _die(*CONFIGS["pipe4"])
    result = {"process": jax.process_index(), "local_devices": jax.local_device_count()}
    for name in args.configs:
        shape, names, schedule, options = CONFIGS[name]
        start = time.perf_counter()
        _, result[name] = train(make_mesh(shape, names), schedule, options, STEPS)
        print(f"{name}: {STEPS} steps in {time.perf_counter() - start:.1f} s", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


def _main_resume(args):
    from jaxpipe import checkpoint

    shape, names, schedule, options = CONFIGS["pipe4"]
    mesh = make_mesh(shape, names)
    pipe = make_pipeline(mesh, schedule, options)
    template = shard_state(pipe, *initial_state(pipe.num_logical_stages))
    step = checkpoint.latest_step(args.checkpoint)
    state = checkpoint.restore(args.checkpoint, step, target=template, pipeline=pipe)
    state, losses = train(mesh, schedule, options, RESUME_STEPS - step, state, first_step=step)
    import jax

    leaves = jax.tree_util.tree_leaves(host_tree(state))
    np.savez(args.out, *leaves, losses=np.asarray(losses), restored_step=step)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "die", "resume"])
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.mode == "resume":
        _main_resume(args)
    else:
        _main_multiprocess(args)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
