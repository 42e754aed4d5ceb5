"""The smallest complete jaxpipe program: a residual MLP cut into pipeline stages.

python3 examples/mlp_pipeline.py --schedule zbv
"""

import argparse
import os

parser = argparse.ArgumentParser(description="A residual MLP trained under a pipeline schedule.")
parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved_1f1b, zbv, ...")
parser.add_argument("--stages", type=int, default=4, help="devices on the pipe axis")
parser.add_argument("--microbatches", type=int, default=8)
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

# No GPU or TPU? Split the CPU into 8 host devices (only the CPU backend reads this flag).
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jaxpipe  # noqa: E402

S, M, WIDTH = args.stages, args.microbatches, 32
print(f"platform: {jax.default_backend()}, devices: {jax.devices()[:S]}")
mesh = jax.make_mesh(
    (S,), ("pipe",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:S]
)
jax.set_mesh(mesh)  # new arrays live on the mesh: the training step compiles once
schedule = jaxpipe.schedules.get(args.schedule, S, M)


def stage_fn(p, x):
    """One pipeline stage: a residual MLP block. It keeps x's shape and dtype."""
    return x + jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def loss_fn(loss_params, y, target):
    """Runs on the last stage, once per micro-batch."""
    return jnp.mean((y - target) ** 2)


pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh, schedule=schedule)


def init_stage(key):
    """One stage's parameters."""
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (WIDTH, 4 * WIDTH)) / WIDTH**0.5,
        "b1": jnp.zeros((4 * WIDTH,)),
        "w2": 0.1 * jax.random.normal(k2, (4 * WIDTH, WIDTH)) / WIDTH,
    }


# Every stage's parameters, created directly in the pipeline's device layout: leaves
# [v, S, ...] with S over the pipe axis, so each device holds (and creates) its own stages.
params = pipe.init(init_stage, jax.random.key(0))
inputs = jax.random.normal(jax.random.key(1), (16 * M, WIDTH))
targets = jnp.sin(2 * inputs)  # something to learn
optimizer = optax.adam(1e-2)
opt_state = optimizer.init(params)


@jax.jit
def train_step(params, opt_state, x, t):
    loss, grads = jax.value_and_grad(pipe.loss)(params, None, x, t)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss


for step in range(args.steps):
    params, opt_state, loss = train_step(params, opt_state, inputs, targets)
    print(f"step {step:3d} | {schedule.name} | loss {float(loss):.4f}")
