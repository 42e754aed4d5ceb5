"""Every bad input of docs/errors.md raises its documented error, before anything is traced;
and `Pipeline.first_nonfinite` names the stage and micro-batch where a NaN or inf starts.

Each entry: a function that makes the mistake, the exception type, and a regex that the
message must match; the regex asks for what was given *and* what is expected.
"""

import os
import re
import warnings

import jax
import jax.numpy as jnp
import models
import multihost_worker as worker
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpipe import _checks as checks
from jaxpipe import checkpoint, pipeline, schedules

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "errors.md")
S, M, BATCH = 4, 4, 16


def _pipe(stage_fn=models.stage_fn, loss_fn=models.loss_fn, **kwargs):
    kwargs.setdefault("mesh", models.pipe_mesh(S))
    kwargs.setdefault("schedule", "1f1b")
    if isinstance(kwargs["schedule"], str):
        kwargs.setdefault("num_microbatches", M)
    return pipeline.Pipeline(stage_fn, loss_fn, **kwargs)


def _args(batch=BATCH, num_stages=S, place=True):
    stage_params, loss_params = models.init(jax.random.key(0), num_stages)
    if place:
        stage_params = jax.tree_util.tree_map(lambda a: a[None], stage_params)  # [1, S, ...]
    inputs, targets = models.data(jax.random.key(1), batch)
    return stage_params, loss_params, inputs, targets


def side_input_wrong_shape():
    def stage(p, x, *, side):
        return models.stage_fn(p, x) + side

    stage_params, loss_params, inputs, targets = _args()
    side = jnp.ones((BATCH, 3))
    _pipe(stage_fn=stage).loss(stage_params, loss_params, inputs, targets, side=side)


def scanning_stage_carry_changes_dtype():
    def stage(p, x):  # two blocks, the way docs/transformers.md scans over its blocks
        blocks = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), p)
        return jax.lax.scan(lambda h, q: (models.stage_fn(q, h), None), x, blocks)[0]

    stage_params, loss_params, inputs, targets = _args()
    inputs = inputs.astype(jnp.bfloat16)
    _pipe(stage_fn=stage).loss(stage_params, loss_params, inputs, targets)


def mesh_without_pipe_axis():
    mesh = jax.make_mesh(
        (4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4]
    )
    _pipe(mesh=mesh)


def schedule_for_another_num_stages():
    _pipe(schedule=schedules.get("1f1b", 2, M))


def num_microbatches_differs_from_schedule():
    _pipe(schedule=schedules.get("1f1b", S, 8), num_microbatches=M)


def batch_not_divisible_by_num_microbatches():
    stage_params, loss_params, inputs, targets = _args(batch=10)
    _pipe().loss(stage_params, loss_params, inputs, targets)


def batch_not_divisible_by_microbatches_times_replicas():
    mesh = models.pipe_mesh(S, extra=(("data", 2),))
    stage_params, loss_params, inputs, targets = _args(batch=12)
    _pipe(mesh=mesh).loss(stage_params, loss_params, inputs, targets)


def num_microbatches_missing():
    pipeline.Pipeline(models.stage_fn, models.loss_fn, mesh=models.pipe_mesh(S), schedule="1f1b")


def schedule_option_unknown():
    _pipe(schedule="1f1b", schedule_options={"virtual_stages": 2})


def schedule_option_misspelt():
    _pipe(schedule="interleaved_1f1b", schedule_options={"virtual_stage": 2})


def float32_params_bfloat16_activations():
    stage_params, loss_params, inputs, targets = _args()
    _pipe().loss(stage_params, loss_params, inputs.astype(jnp.bfloat16), targets)


def mixed_dtype_params():
    stage_params, loss_params, inputs, targets = _args()
    half = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), stage_params)
    half["w2"] = stage_params["w2"]  # one leaf left in float32
    _pipe().loss(half, loss_params, inputs.astype(jnp.bfloat16), targets)


def targets_as_a_tuple():
    stage_params, loss_params, inputs, targets = _args()
    _pipe().loss(stage_params, loss_params, inputs, (targets, targets))


def targets_without_the_sequence_axis():
    def token_loss(lp, y, target):  # y (rows, T, width); target (rows, T) class ids
        logits = y @ lp["head"]
        return -jnp.mean(jnp.take_along_axis(logits, target[:, :, None], axis=-1))

    stage_params, loss_params, inputs, _ = _args()
    sequences = jnp.repeat(inputs[:, None, :], 5, axis=1)  # [16, 5, 8]
    labels = jnp.zeros((BATCH,), jnp.int32)  # one label per sequence, not per position
    _pipe(loss_fn=token_loss).loss(stage_params, loss_params, sequences, labels)


def stage_axis_not_num_logical_stages():
    stage_params, loss_params, inputs, targets = _args(num_stages=3)
    _pipe().loss(stage_params, loss_params, inputs, targets)


def params_in_logical_order():
    stage_params, loss_params, inputs, targets = _args(place=False)
    _pipe().loss(stage_params, loss_params, inputs, targets)


def params_placed_for_another_layout():
    stage_params, loss_params, inputs, targets = _args(num_stages=8, place=False)
    interleaved = _pipe(schedule="interleaved_1f1b", schedule_options={"virtual_stages": 2})
    placed = interleaved.place(stage_params)
    _pipe(schedule="zbv").loss(placed, loss_params, inputs, targets)


def params_reshaped_by_hand():
    stage_params, loss_params, inputs, targets = _args(num_stages=8, place=False)
    by_hand = jax.tree_util.tree_map(lambda a: a.reshape(2, S, *a.shape[1:]), stage_params)
    _pipe(schedule="zbv").loss(by_hand, loss_params, inputs, targets)


def params_sharded_by_hand_in_no_layout():
    mesh = models.pipe_mesh(S, (("tensor", 2),))
    stage_params, loss_params, inputs, targets = _args()
    sharding = jax.sharding.NamedSharding(mesh, P(None, "tensor"))  # S over tensor
    _pipe(mesh=mesh).loss(jax.device_put(stage_params, sharding), loss_params, inputs, targets)


def placement_spec_of_an_axis_the_mesh_lacks():
    stage_params, _, _, _ = _args(place=False)
    specs = {
        "b1": None,
        "scale": None,
        "w1": jax.sharding.PartitionSpec(None, "tensor"),
        "w2": None,
    }
    _pipe().place(stage_params, specs)


def stage_fn_changes_shape():
    _pipe(stage_fn=lambda p, x: models.stage_fn(p, x)[:, :3]).loss(*_args())


def stage_fn_changes_dtype():
    _pipe(stage_fn=lambda p, x: models.stage_fn(p, x).astype(jnp.bfloat16)).loss(*_args())


def loss_fn_not_scalar():
    _pipe(loss_fn=lambda lp, y, t: (y @ lp["head"] - t) ** 2).loss(*_args())


def loss_fn_returns_pair():
    _pipe(loss_fn=lambda lp, y, t: (models.loss_fn(lp, y, t), {"mse": 0.0})).loss(*_args())


def loss_aux_not_numeric():
    def loss_fn(lp, y, t):
        return models.loss_fn(lp, y, t), {"key": jax.random.key(0)}

    _pipe(loss_fn=loss_fn, loss_has_aux=True).loss(*_args())


def loss_weight_not_scalar():
    _pipe(loss_reduction=lambda t: jnp.sum(t, axis=1)).loss(*_args())


def loss_weights_sum_to_zero():
    stage_params, loss_params, inputs, targets = _args()
    _pipe(loss_reduction=lambda t: jnp.sum(t * 0)).loss(stage_params, loss_params, inputs, targets)


def loss_reduction_unknown():
    _pipe(loss_reduction="max")


def loss_reduction_with_weight_updates():
    _pipe(schedule="pipedream", loss_reduction="sum")


def targets_batch_differs():
    stage_params, loss_params, inputs, targets = _args()
    _pipe().loss(stage_params, loss_params, inputs, targets[:8])


def unknown_schedule_name():
    _pipe(schedule="zigzag")


def interleaved_virtual_stages_not_positive():
    _pipe(schedule="interleaved_1f1b", num_microbatches=6, schedule_options={"virtual_stages": 0})


def dualpipev_too_few_microbatches():
    _pipe(schedule="dualpipev", num_microbatches=6)


def _csv(tmp_path, old, new):
    text = schedules.to_csv(schedules.get("gpipe", 2, 2))
    assert old in text
    path = tmp_path / "schedule.csv"
    path.write_text(text.replace(old, new))
    return path


def csv_with_unknown_op(tmp_path):
    schedules.from_csv(_csv(tmp_path, "0,0,F,0,0,0", "0,0,X,0,0,0"))


def csv_backward_before_forward(tmp_path):
    # Stage 1 runs the backward of micro-batch 0 in tick 1, before its forward (tick 1).
    schedules.from_csv(_csv(tmp_path, "3,1,BW,1,0,0", "0,1,BW,1,0,0"))


def csv_version_without_update(tmp_path):
    # A forward reading weight version 1, but no U (weight update) ran before it.
    schedules.from_csv(_csv(tmp_path, "1,0,F,0,1,0", "1,0,F,0,1,1"))


def checkpoint_from_a_different_model(tmp_path):
    mesh = models.pipe_mesh(2)
    checkpoint.save(tmp_path, 7, {"params": worker.initial_state(2, width=8)})
    target = {"params": worker.initial_state(2, width=6)}
    checkpoint.restore(tmp_path, target=target, mesh=mesh)


def stage_closes_over_a_differentiated_value():
    stage_params, loss_params, inputs, targets = _args()

    def loss(scale):
        pipe = _pipe(stage_fn=lambda p, x: models.stage_fn(p, x) * scale)
        return pipe.loss(stage_params, loss_params, inputs, targets)

    jax.grad(loss)(jnp.float32(2.0))


def nnx_state_wrapped_in_a_placed_of_another_layout():
    from flax import nnx

    import jaxpipe

    interleaved = _pipe(schedule="interleaved_1f1b", schedule_options={"virtual_stages": 2})
    zbv = _pipe(schedule="zbv")
    stage_params, loss_params, inputs, targets = _args(num_stages=2 * S, place=False)
    state = interleaved.place(nnx.State({k: nnx.Param(v) for k, v in stage_params.items()}))
    zbv.loss(jaxpipe.Placed(state.tree, zbv.layout.order), loss_params, inputs, targets)


def optimizer_state_of_logical_parameters():
    import optax

    stage_params, loss_params, inputs, targets = _args(place=False)
    pipe, optimizer = _pipe(), optax.adam(1e-2)
    state = optimizer.init(stage_params)
    pipe.train(optimizer, pipe.place(stage_params), state, loss_params, inputs, targets)


def jitted_optimizer_init_of_placed_parameters():
    import optax

    stage_params = _args(place=False)[0]
    jax.jit(optax.adam(1e-2).init)(_pipe().place(stage_params))


# id (as in docs/errors.md): (mistake, exception, message regex)
ENTRIES = {
    "side-input-wrong-shape": (
        side_input_wrong_shape,
        ValueError,
        r"(?s)stage_fn failed on one micro-batch, raising TypeError: .*\n  parameters \(one "
        r"stage\): \['b1'\] \(16,\) float32, .*\['w2'\] \(16, 8\) float32\n  "
        r"x: <array> \(4, 8\) float32\n  "
        r"side: <array> \(4, 3\) float32\n  key: None\n.*Fix: make stage_fn accept",
    ),
    "scan-carry-dtype": (
        scanning_stage_carry_changes_dtype,
        ValueError,
        r"(?s)stage_fn failed .*x: <array> \(4, 8\) bfloat16.*Fix: a lax.scan inside stage_fn "
        r"changed its carry's dtype: the activations are bfloat16 .*Cast the parameters",
    ),
    "mesh-without-pipe-axis": (
        mesh_without_pipe_axis,
        ValueError,
        r"mesh has axes \('data',\) but no axis named 'pipe'; build the mesh with a pipe axis",
    ),
    "schedule-for-another-num-stages": (
        schedule_for_another_num_stages,
        ValueError,
        r"schedule '1f1b' is for 2 devices but mesh axis 'pipe' has 4; build the schedule for 4",
    ),
    "num-microbatches-differs-from-schedule": (
        num_microbatches_differs_from_schedule,
        ValueError,
        r"num_microbatches=4 but the schedule has 8",
    ),
    "batch-not-divisible": (
        batch_not_divisible_by_num_microbatches,
        ValueError,
        r"batch size 10 does not split into num_microbatches=4 equal micro-batches; use a batch "
        r"size that is a multiple of 4 \(e\.g\. 8 or 12\)",
    ),
    "batch-not-divisible-by-replicas": (
        batch_not_divisible_by_microbatches_times_replicas,
        ValueError,
        r"batch size 12 does not split into num_microbatches=4 equal micro-batches on each of "
        r"2 data-parallel replicas \(M x replicas = 8\); use a batch size that is a multiple "
        r"of 8 \(e\.g\. 8 or 16\)",
    ),
    "num-microbatches-missing": (
        num_microbatches_missing,
        ValueError,
        r"num_microbatches is required with a schedule name: schedule='1f1b' was given without "
        r"it; pass num_microbatches=M",
    ),
    "schedule-option-unknown": (
        schedule_option_unknown,
        ValueError,
        r"schedule '1f1b' takes no option 'virtual_stages'; its options: overlap, "
        r"split_backward \('virtual_stages' is an option of interleaved_1f1b, interleaved_zb\)",
    ),
    "schedule-option-misspelt": (
        schedule_option_misspelt,
        ValueError,
        r"schedule 'interleaved_1f1b' takes no option 'virtual_stage' \(did you mean "
        r"'virtual_stages'\?\); its options: virtual_stages, split_backward",
    ),
    "float32-params-bfloat16-activations": (
        float32_params_bfloat16_activations,
        ValueError,
        r"input \(4, 8\) bfloat16, output \(4, 8\) float32\. The activations are bfloat16 "
        r"but stage parameters \['b1'\] \(float32\), .* are wider.*cast the parameters to "
        r"the activations' dtype inside stage_fn",
    ),
    "mixed-dtype-params": (
        mixed_dtype_params,
        ValueError,
        r"input \(4, 8\) bfloat16, output \(4, 8\) float32\. The activations are bfloat16 "
        r"but stage parameters \['w2'\] \(float32\) are wider",
    ),
    "targets-tuple": (
        targets_as_a_tuple,
        ValueError,
        r"loss_fn failed on one micro-batch: .*raised TypeError: .*targets is a tuple of 2 "
        r"arrays: loss_fn receives it whole.*unpack it inside loss_fn",
    ),
    "targets-missing-axis": (
        targets_without_the_sequence_axis,
        ValueError,
        r"loss_fn failed on one micro-batch: loss_fn\(loss_params, y, target\) with y "
        r"\(4, 5, 8\) float32 .*target \(4,\) int32 .*raised IndexError.*target has 1 axes "
        r"where y has 3: .* would be \(4, 5\) per micro-batch, so targets of shape "
        r"\(batch, 5\)",
    ),
    "stage-axis-length": (
        stage_axis_not_num_logical_stages,
        ValueError,
        r"stage_params leaf \['b1'\] has shape \(1, 3, 16\); the pipeline keeps stage "
        r"parameters in its device layout, leaves \[v, S, ...\] = \[1, 4, ...\]",
    ),
    "params-not-placed": (
        params_in_logical_order,
        ValueError,
        r"stage_params leaf \['b1'\] has shape \(4, 16\); the pipeline keeps stage parameters "
        r"in its device layout, leaves \[v, S, ...\] = \[1, 4, ...\]; it looks like logical "
        r"stage order \[N, ...\]: call pipe.place\(params\)",
    ),
    "params-placed-for-another-layout": (
        params_placed_for_another_layout,
        ValueError,
        r"stage_params were placed for another layout of the same shapes: device d holds "
        r"logical stages d0: 0, 4; d1: 1, 5; .* but d0: 0, 7; d1: 1, 6; .* in this pipeline's"
        r".*stage_params = pipe.place\(stage_params\)",
    ),
    "params-bare-several-layouts": (
        params_reshaped_by_hand,
        ValueError,
        r"stage_params are bare arrays \[v, S, ...\] = \[2, 4, ...\]: they do not say which "
        r"layout they are in.*pipe.place\(logical_params\)",
    ),
    "params-sharded-in-no-layout": (
        params_sharded_by_hand_in_no_layout,
        ValueError,
        r"stage_params leaf \['b1'\] of shape \(1, 4, 16\) is a bare array sharded "
        r"P\(None, 'tensor', None\), which the pipeline cannot run as it is: its stage axes "
        r"\[v, S\] are split P\(None, 'tensor'\), where the pipeline keeps them "
        r"P\(None, 'pipe'\)\. .*stage_params = pipe.place\(logical_params, specs\)",
    ),
    "placement-spec-the-mesh-cannot-apply": (
        placement_spec_of_an_axis_the_mesh_lacks,
        ValueError,
        r"logical_params leaf \['w1'\] of shape \(4, 8, 16\) is given placement spec "
        r"P\(None, 'tensor'\), for its dimensions after the stage axis \(8, 16\), on a mesh of "
        r"axes \{'pipe': 4\} \(pipe axis 'pipe'\): it names axis 'tensor', which the mesh "
        r"does not have; name only the mesh's axes",
    ),
    "stage-fn-changes-shape": (
        stage_fn_changes_shape,
        ValueError,
        r"stage_fn must return the structure, shapes and dtypes of its input.*input \(4, 8\) "
        r"float32, output \(4, 3\) float32",
    ),
    "stage-fn-changes-dtype": (
        stage_fn_changes_dtype,
        ValueError,
        r"stage_fn must return the structure, shapes and dtypes of its input.*input \(4, 8\) "
        r"float32, output \(4, 8\) bfloat16\. The activations are float32 and the parameters "
        r"are not wider.*y\.astype\(x\.dtype\)",
    ),
    "loss-fn-not-scalar": (
        loss_fn_not_scalar,
        ValueError,
        r"loss_fn must return a scalar per micro-batch, got \(4, 3\)",
    ),
    "loss-fn-returns-pair": (
        loss_fn_returns_pair,
        ValueError,
        r"loss_fn returned a tuple of 2 items where a scalar loss is expected; .*pass "
        r"loss_has_aux=True",
    ),
    "loss-aux-not-numeric": (
        loss_aux_not_numeric,
        ValueError,
        r"the aux loss_fn returns has a leaf aux\['key'\] of key<fry>, which cannot be "
        r"combined",
    ),
    "loss-weight-not-scalar": (
        loss_weight_not_scalar,
        ValueError,
        r"loss_reduction's weight_fn\(target\) must return a real scalar per micro-batch .*"
        r"got \(4,\)",
    ),
    "loss-weights-sum-to-zero": (
        loss_weights_sum_to_zero,
        ValueError,
        r"loss_reduction's weights, weight_fn\(target\) of each of the step's 4 micro-batches "
        r".*sum to 0, so the weighted mean .* divides by zero; pass a batch with a nonzero",
    ),
    "loss-reduction-unknown": (
        loss_reduction_unknown,
        ValueError,
        r"loss_reduction must be 'mean', 'sum' or a function weight_fn\(target\) -> scalar",
    ),
    "loss-reduction-with-weight-updates": (
        loss_reduction_with_weight_updates,
        ValueError,
        r"schedule 'pipedream' updates weights .* use loss_reduction='mean'",
    ),
    "targets-batch-differs": (
        targets_batch_differs,
        ValueError,
        r"targets has shape \(8, 3\) but inputs have batch size 16",
    ),
    "unknown-schedule": (
        unknown_schedule_name,
        ValueError,
        r"unknown schedule 'zigzag'; known schedules: .*1f1b.*gpipe",
    ),
    "interleaved-virtual-stages": (
        interleaved_virtual_stages_not_positive,
        ValueError,
        r"interleaved_1f1b: virtual_stages must be a positive int, got 0",
    ),
    "dualpipev-microbatches": (
        dualpipev_too_few_microbatches,
        ValueError,
        r"dualpipev needs num_microbatches >= 2 \* num_stages = 8, got num_microbatches=6 .*"
        r"use at least 8 micro-batches",
    ),
    "csv-unknown-op": (
        csv_with_unknown_op,
        ValueError,
        r"schedule\.csv, line 10: unknown op 'X'; expected one of F, B, W, BW, U",
    ),
    "csv-version-without-update": (
        csv_version_without_update,
        ValueError,
        r"schedule\.csv \(the marked cell is line 11\): .*tick 1, device 0.*reads version 1, "
        r"but the newest version of stage 0 at that tick is 0",
    ),
    "csv-broken-dependency": (
        csv_backward_before_forward,
        ValueError,
        r"schedule\.csv \(the marked cell is line \d+\): .*tick 0, device 1.*needs the F of "
        r"stage 1, micro-batch 0 in an earlier tick",
    ),
    "checkpoint-from-different-model": (
        checkpoint_from_a_different_model,
        ValueError,
        r"checkpoint from a different model \(.*, step 7\): leaf \['params'\]\[0\]\['b1'\] has "
        r"shape \(2, 16\) in the checkpoint but \(2, 12\) in the target",
    ),
    "stage-closes-over-differentiated-value": (
        stage_closes_over_a_differentiated_value,
        ValueError,
        r"stage_fn closes over `scale` \(float32\[\], stage_fn, every stage\), which jax.grad "
        r".*UnexpectedTracerError\. Fix: pass the value in as an argument: stage parameters in "
        r"params .*, or a side input \(side=",
    ),
    "placed-around-nnx-state-of-another-layout": (
        nnx_state_wrapped_in_a_placed_of_another_layout,
        ValueError,
        r"stage_params is a jaxpipe.Placed that names the layout with device d holding logical "
        r"stages d0: 0, 7; .* around NNX variables that pipe.place put in another: d0: 0, 4; "
        r".*pass nnx.state\(module, nnx.Param\) without jaxpipe.Placed",
    ),
    "opt-state-of-logical-parameters": (
        optimizer_state_of_logical_parameters,
        ValueError,
        r"opt_state leaf .*mu\['b1'\] has shape \(4, 16\) where pipe.train needs "
        r"\(1, 4, 16\): it was built from parameters in logical stage order .*Fix: opt_state = "
        r"pipe.init_optimizer\(optimizer, params\)",
    ),
    "jit-optimizer-init": (
        jitted_optimizer_init_of_placed_parameters,
        ValueError,
        r"placed leaf \['b1'\] of shape \(1, 4, 16\) has sharding SingleDeviceSharding.*"
        r"not split over the 4 pipe devices.*opt_state = optimizer.init\(params\)",
    ),
}


# Slow: a checkpoint written to disk and read back.
SLOW = {"checkpoint-from-different-model"}


@pytest.mark.parametrize(
    "entry", [e if e not in SLOW else pytest.param(e, marks=pytest.mark.slow) for e in ENTRIES]
)
def test_bad_input_raises_its_documented_error(entry, tmp_path):
    mistake, error, message = ENTRIES[entry]
    args = (tmp_path,) if "tmp_path" in mistake.__code__.co_varnames else ()
    with pytest.raises(error, match=message):
        mistake(*args)


def test_every_documented_error_has_a_test_and_back():
    with open(DOCS, encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("| `")]
    documented = [re.match(r"\| `([a-z0-9-]+)`", row)[1] for row in rows]
    assert sorted(documented) == sorted([*ENTRIES, *LOCATED])
    assert all(callable(globals()[name]) for name in LOCATED.values())


def test_csv_dependency_in_the_same_tick_is_rejected(tmp_path):
    # Stage 1 starts micro-batch 0 in tick 0, the tick in which stage 0 produces it.
    path = _csv(tmp_path, "1,1,F,1,0,0", "0,1,F,1,0,0")
    with pytest.raises(ValueError, match=r"needs the F of stage 0, micro-batch 0 in an earlier"):
        schedules.from_csv(path)


def test_a_forward_only_table_gives_losses_and_refuses_gradients_early():
    # A table of F rows alone is valid (every backward is missing), so pipe.loss runs it;
    # gradients are refused by name, not with an IndexError from inside the executor.
    rows = [(0, 0, 0, 0), (1, 0, 0, 1), (1, 1, 1, 0), (2, 1, 1, 1)]
    text = "# num_stages: 2\n# num_microbatches: 2\ntick,device,op,stage,microbatch\n"
    text += "".join(f"{t},{d},F,{s},{m}\n" for t, d, s, m in rows)
    schedule = schedules.from_csv_text(text)
    pipe = _pipe(mesh=models.pipe_mesh(2), schedule=schedule)
    stage_params, loss_params, inputs, targets = _args(num_stages=2)
    loss = pipe.loss(stage_params, loss_params, inputs, targets)
    assert np.isfinite(loss)
    message = r"schedule 'custom' has no backward actions \(a forward-only table\).*BW row"
    with pytest.raises(ValueError, match=message):
        pipe.loss_and_grads(stage_params, loss_params, inputs, targets)
    with pytest.raises(ValueError, match=message):
        jax.grad(pipe.loss)(stage_params, loss_params, inputs, targets)


# ------------------------------------------------------------------ non-finite location
# id (as in docs/errors.md): the test that shows what first_nonfinite says
LOCATED = {
    "nonfinite-input": "test_first_nonfinite_names_the_microbatch_of_a_bad_input_row",
    "nonfinite-weight": "test_first_nonfinite_names_the_stage_of_a_bad_weight",
}


@pytest.mark.slow
def test_first_nonfinite_names_the_microbatch_of_a_bad_input_row():
    pipe = _pipe()
    stage_params, loss_params, inputs, targets = _args()
    assert pipe.first_nonfinite(stage_params, loss_params, inputs, targets) is None

    row = 6  # micro-batch m holds rows 4m .. 4m + 3 (B = 16, M = 4): row 6 is in 1
    bad_inputs = inputs.at[row, 3].set(jnp.nan)
    where = pipe.first_nonfinite(stage_params, loss_params, bad_inputs, targets)
    assert where is not None
    assert (where["op"], where["stage"], where["microbatch"]) == ("F", 0, row // (BATCH // M))
    assert where["device"] == 0


def test_first_nonfinite_names_the_stage_of_a_bad_weight():
    pipe = _pipe()
    stage_params, loss_params, inputs, targets = _args()
    stage = 2  # an infinite weight poisons that stage's first forward, of micro-batch 0
    bad_params = dict(stage_params, w2=stage_params["w2"].at[0, stage, 1, 5].set(jnp.inf))
    where = pipe.first_nonfinite(bad_params, loss_params, inputs, targets)
    assert where is not None
    assert (where["op"], where["stage"], where["microbatch"]) == ("F", stage, 0)
    assert where["device"] == stage


def test_first_nonfinite_names_the_backward_of_a_bad_weight_gradient_however_gathered():
    """A weight gradient that alone is not finite (the forward and the input gradient are):
    the backward that made it is named, whether the tick gathers the weights ahead (its
    gradient waits a tick to be reduce-scattered), each action gathers its own or the
    stage gathers them where it uses them (per block). Gathered
    ahead, the next backward on that device was named, of another stage or micro-batch."""

    def stage_fn(p, x):  # sqrt'(0) is infinite: 0 * inf poisons b's gradient only
        return jnp.tanh(x @ p["w"]) + 0.0 * jnp.sqrt(jnp.abs(p["b"]))

    def loss_fn(head, y, target):
        return jnp.mean((y @ head - target) ** 2)

    rng = np.random.default_rng(0)
    stages, width, rows = 4, 8, 16
    weights = {
        "w": jnp.asarray(rng.normal(size=(stages, width, width)) / 3, jnp.float32),
        "b": jnp.asarray(rng.uniform(1, 2, size=(stages, width)), jnp.float32),
    }
    weights["b"] = weights["b"].at[2, 3].set(0.0)  # stage 2's
    head = jnp.asarray(rng.normal(size=(width, 2)), jnp.float32)
    inputs = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
    targets = jnp.asarray(rng.normal(size=(rows, 2)), jnp.float32)
    mesh = models.pipe_mesh(2, extra=(("fsdp", 2),))
    found = {}
    for gather in ("per_use", "ahead", "per_block"):
        pipe = _pipe(stage_fn, loss_fn, mesh=mesh, schedule="zbv", fsdp_gather=gather)
        params = pipe.place(weights, {"w": P("fsdp", None), "b": P("fsdp")})
        found[gather] = pipe.first_nonfinite(params, head, inputs, targets)
    assert found["per_use"] is not None
    assert (found["per_use"]["op"], found["per_use"]["stage"]) == ("backward", 2)
    assert found["ahead"] == found["per_use"] == found["per_block"]


@pytest.mark.parametrize(
    "typed, suggested",
    [("1F1B", "1f1b"), ("interleaved", "interleaved_1f1b"), ("GPipe", "gpipe"), ("zbvv", "zbv")],
)
def test_schedule_name_suggestion_ignores_case_and_prefers_prefix(typed, suggested):
    with pytest.raises(
        ValueError, match=rf"unknown schedule '{typed}' \(did you mean '{suggested}'\?\)"
    ):
        schedules.get(typed, 4, 8)


def _idle_axis_warnings(name):
    """Warnings about axes with no role from two steps on a mesh (pipe 4, ``name`` 2);
    each step's loss is the plain model's (an axis with no role runs replicated)."""
    stage_params, loss_params, inputs, targets = _args()
    pipe = _pipe(mesh=models.pipe_mesh(S, extra=((name, 2),)))
    logical = jax.tree_util.tree_map(lambda a: a[0], stage_params)
    want = models.sequential_loss(logical, loss_params, inputs, targets, M)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            loss = pipe.loss(stage_params, loss_params, inputs, targets)
            np.testing.assert_allclose(loss, want, rtol=1e-6)
    return [str(w.message) for w in caught if "no role" in str(w.message)]


def test_a_mesh_axis_with_no_role_is_warned_about_once_and_runs_replicated():
    (message,) = _idle_axis_warnings("dp")
    assert "mesh axis 'dp' (size 2) has no role" in message
    assert "data_axes=('dp',)" in message and "specs of `place` or `init`" in message
    assert _idle_axis_warnings("data") == []


def test_a_mesh_axis_named_by_a_placement_spec_or_data_axes_has_a_role():
    mesh = models.pipe_mesh(S, extra=(("dp", 2),))
    spec = jax.sharding.PartitionSpec(None, "dp")
    assert checks.idle_axes_warning(mesh, "pipe", ("dp",), (), {}) is None
    assert checks.idle_axes_warning(mesh, "pipe", (), (None, spec), {}) is None
    assert "'dp'" in checks.idle_axes_warning(mesh, "pipe", (), (None,), {})


def test_nnx_stage_missing_batchnorm_state_says_why():
    """Only the ``nnx.Param`` state of a stage with BatchNorm: the message names the
    non-Param state (BatchNorm's running statistics), the leaves given, and the fix."""
    from flax import nnx

    class Stage(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(models.WIDTH, models.WIDTH, rngs=rngs)
            self.norm = nnx.BatchNorm(models.WIDTH, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.linear(x), use_running_average=True)

    graphdef = nnx.graphdef(Stage(nnx.Rngs(0)))
    make = jax.vmap(lambda k: nnx.state(Stage(nnx.Rngs(k)), nnx.Param))
    params = jax.tree_util.tree_map(lambda a: a[None], make(jax.random.split(jax.random.key(0), S)))
    _, loss_params, inputs, targets = _args()
    pipe = _pipe(stage_fn=lambda p, x: nnx.merge(graphdef, p)(x))
    with pytest.raises(ValueError) as caught:
        pipe.loss(params, loss_params, inputs, targets)
    message = str(caught.value)
    assert "Incorrect number of leaves" in message and "['norm']['scale']" in message
    assert "modules with state other than nnx.Param: BatchNorm (nnx.BatchStat)," in message
    assert "Linear" not in message  # only the module that holds the state is named
    assert "nnx.LayerNorm, nnx.RMSNorm" in message and len(message.splitlines()) <= 8


def test_loss_failure_names_loss_params_side_and_key_shapes():
    with pytest.raises(ValueError) as caught:
        targets_as_a_tuple()
    message = str(caught.value)
    assert "\n  loss_params: ['head'] (8, 3) float32\n  side: None\n  key: None" in message
    assert len(message.splitlines()) <= 6
