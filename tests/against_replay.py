"""`Pipeline.train` held to `jaxpipe.replay.replay`, the sequential replay of its table."""

import jax
import jax.numpy as jnp
import models
import numpy as np

from jaxpipe import replay


def train_against_replay(
    pipe, optimizer, stage_fn, loss_fn, stage_params, loss_params, batches, *, tol=1e-5,
    opt_state_atol=None,
):  # fmt: skip
    """Trains with ``pipe.train`` and with the replay of ``pipe.schedule`` side by side.

    Args:
      pipe: the `jaxpipe.Pipeline` under test.
      optimizer: the optax optimizer both apply per stage.
      stage_fn: the stage function(s) ``pipe`` was built with.
      loss_fn: the loss function ``pipe`` was built with.
      stage_params: logical stage parameters, leaves ``[S * v, ...]``.
      loss_params: the loss parameters (not trained).
      batches: one dict per step with ``inputs`` and ``targets``, and optionally ``side``
        and ``key``.
      tol: relative tolerance of the losses (each step) and of the final parameters.
      opt_state_atol: if given, the final optimizer states are compared too, with relative
        tolerance ``tol`` and this absolute tolerance.

    Returns:
      ``(params, replayed)``: the pipeline's final parameters in logical order and the
      replay's.
    """
    ref_params, ref_states = stage_params, replay.init_opt_states(optimizer, stage_params)
    params = pipe.place(stage_params)
    opt_state = pipe.init_optimizer(optimizer, params)
    step = jax.jit(
        lambda p, o, lp, x, t, side, key: pipe.train(optimizer, p, o, lp, x, t, side=side, key=key)
    )
    for batch in batches:
        side, key = batch.get("side"), batch.get("key")
        params, opt_state, losses = step(
            params, opt_state, loss_params, batch["inputs"], batch["targets"], side, key
        )
        ref_params, ref_states, ref_losses = replay.replay(
            pipe.schedule, stage_fn, loss_fn, ref_params, loss_params, optimizer, ref_states,
            batch["inputs"], batch["targets"], side=side, key=key,
            num_replicas=pipe.num_replicas,
        )  # fmt: skip
        np.testing.assert_allclose(losses, ref_losses, rtol=tol)
    logical = pipe.logical(params)
    assert models.relative_error(logical, ref_params) < tol
    if opt_state_atol is not None:
        stacked = jax.tree_util.tree_map(lambda *s: jnp.stack(s), *ref_states)
        for got, want in zip(
            jax.tree_util.tree_leaves(pipe.logical(opt_state)),
            jax.tree_util.tree_leaves(stacked),
            strict=True,
        ):
            np.testing.assert_allclose(got, want, rtol=tol, atol=opt_state_atol)
    return logical, ref_params
