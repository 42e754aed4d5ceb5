"""A MaxText-style circular GPipe, written plainly, against jaxpipe's circular, 1f1b and
interleaved_1f1b at the same model, S and M.

The baseline is what MaxText's and praxis's pipeline layers do: the stage weights are laid
out ``[S, r, ...]`` with the stage axis sharded over ``pipe``; a ``[S, mb, ...]`` state holds
one micro-batch per stage; one ``lax.scan`` runs ``M*r + S - 1`` iterations, each applying
every stage at once (``vmap`` over the stage axis; stages in fill or drain compute on junk)
and shifting the state one stage on with ``jnp.roll`` (XLA turns it into a collective
permute under the sharding constraints); outputs of the last stage go round again through a
circular buffer until the last repeat. The backward is JAX autodiff through the scan. With
``remat`` the stage computation of each iteration is ``jax.checkpoint``-ed, so the scan keeps
only each iteration's stage inputs (MaxText's remat policies range around this point;
checkpointing the whole iteration instead also saves the circular buffers every iteration,
which is quadratic in M).

Model: ``L = S*r`` blocks of the transformer-style stage in ``benchmarks/common.py``
(width 64). jaxpipe runs it as ``circular(repeats=r)`` and ``interleaved_1f1b(v=r)`` with one
block per logical stage, and as ``1f1b`` with ``r`` blocks per stage. All four are checked
against the sequential reference (loss and gradients) before anything is measured.

Memory: ``memory_analysis().temp_size_in_bytes`` of ``jit(value_and_grad(loss))`` per device.
Simulated time: the lock-step makespan of each table (`jaxpipe.schedules.simulate`), in
units of one block's forward, with each action's cost from XLA's flop count of it
(`block_flops`: about F = B = W = 1 without remat; with remat the backward, or each of B and
W, recomputes the part of the forward it needs); the baseline's table is built from the
same index arithmetic its loop uses (iteration i -> tick i) and validated.

    python benchmarks/maxtext_baseline.py                  # S=4, r=2, M in {8, 32}
    python benchmarks/maxtext_baseline.py --microbatches 8 16 32 64 --stages 4 8
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import common

WIDTH, HIDDEN, ROWS = 64, 256, 16
JAXPIPE_SCHEDULES = ("circular", "interleaved_1f1b", "1f1b")


# ------------------------------------------------------------------ the baseline (plain)
def maxtext_place(stage_params, mesh, num_stages, repeats):
    """Logical ``[S*r, ...]`` -> the baseline's ``[S, r, ...]``, stage axis over ``pipe``
    (logical stage ``c*S + s`` is device ``s``'s chunk ``c``); done once, outside the step."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    S, r = num_stages, repeats
    return jax.device_put(
        jax.tree_util.tree_map(
            lambda p: jnp.swapaxes(p.reshape(r, S, *p.shape[1:]), 0, 1), stage_params
        ),
        NamedSharding(mesh, P("pipe")),
    )


def maxtext_logical(weights):
    """The baseline's ``[S, r, ...]`` -> logical ``[S*r, ...]`` (for comparing gradients)."""
    import jax
    import jax.numpy as jnp

    return jax.tree_util.tree_map(
        lambda p: jnp.swapaxes(p, 0, 1).reshape(-1, *p.shape[2:]), weights
    )


def maxtext_loss(
    weights,
    loss_params,
    inputs,
    targets,
    *,
    mesh,
    num_stages,
    num_microbatches,
    repeats,
    remat=False,
    stage_fn=None,
    loss_fn=None,
):
    """Mean loss over micro-batches of a circular GPipe: vmap over stages, scan over
    iterations, state shifted with jnp.roll; differentiate it with jax.grad. ``weights``
    are in the baseline's layout ``[S, r, ...]`` (`maxtext_place`). ``stage_fn(p, x)`` and
    ``loss_fn(loss_params, y, t)`` default to the benchmark's block and head."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpipe.pipeline import split_microbatches

    S, M, r = num_stages, num_microbatches, repeats
    stage_fn = stage_fn or common.block_fn
    loss_fn = loss_fn or common.head_loss_fn
    if M < S:
        raise ValueError(f"this baseline needs M >= S (got M={M}, S={S})")

    def shard(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    # weights [S, r, ...] (maxtext_place): device s holds logical stages s, S + s, ...
    xs = split_microbatches(inputs, M)  # [M, mb, D]
    ts = split_microbatches(targets, M)
    state = shard(jnp.zeros((S, *xs.shape[1:]), xs.dtype), P("pipe"))
    circ = jnp.zeros_like(xs)  # last-stage outputs waiting for their next repeat
    outs = jnp.zeros_like(xs)  # last-stage outputs of the last repeat
    stage_ids = jnp.arange(S)

    def run_stages(weights, chunk, state):
        w = jax.vmap(
            lambda p, c: jax.tree_util.tree_map(
                lambda a: jax.lax.dynamic_index_in_dim(a, c, 0, keepdims=False), p
            )
        )(weights, chunk)
        return jax.vmap(stage_fn)(w, state)

    # remat: recompute the stages in the backward; the scan then keeps each iteration's
    # stage inputs (the state), as jaxpipe's remat keeps each in-flight stage input
    stages = jax.checkpoint(run_stages) if remat else run_stages

    def iteration(carry, i):
        state, circ, outs = carry
        m0, c0 = i % M, i // M
        first = jnp.where(c0 == 0, xs[m0], circ[m0])
        state = state.at[0].set(first)
        chunk = jnp.clip((i - stage_ids) // M, 0, r - 1)  # repeat each stage runs now
        y = shard(stages(weights, chunk, state), P("pipe"))
        done = i - (S - 1)  # the (micro-batch, repeat) the last stage just finished
        m_last, c_last = done % M, done // M
        valid = done >= 0
        last = y[S - 1]
        circ = circ.at[m_last].set(jnp.where(valid & (c_last < r - 1), last, circ[m_last]))
        outs = outs.at[m_last].set(jnp.where(valid & (c_last == r - 1), last, outs[m_last]))
        state = shard(jnp.roll(y, 1, axis=0), P("pipe"))
        return (state, circ, outs), None

    (_, _, outs), _ = jax.lax.scan(iteration, (state, circ, outs), jnp.arange(M * r + S - 1))
    losses = jax.vmap(loss_fn, in_axes=(None, 0, 0))(loss_params, outs, ts)
    return jnp.mean(losses)


def maxtext_table(S: int, M: int, r: int):
    """The baseline's work as a jaxpipe `Schedule`: iteration i of the scan is tick i
    (forward), and tick 2T-1-i (backward, autodiff runs the scan in reverse)."""
    from jaxpipe.schedules import BW, Action, F, Schedule, validate

    T = M * r + S - 1
    fwd = []
    for i in range(T):
        row = []
        for s in range(S):
            k = i - s  # micro-batch index in the ring order: repeat k // M, micro-batch k % M
            row.append((Action(F, (k // M) * S + s, k % M),) if 0 <= k < M * r else ())
        fwd.append(tuple(row))
    bwd = [
        tuple(tuple(Action(BW, a.stage, a.microbatch) for a in cell) for cell in row)
        for row in reversed(fwd)
    ]
    return validate(
        Schedule(
            name="maxtext_circular",
            num_stages=S,
            num_microbatches=M,
            stage_device=tuple(s % S for s in range(S * r)),
            ticks=tuple(fwd + bwd),
        )
    )


# ------------------------------------------------------------------ jaxpipe, same model
def jaxpipe_case(name, S, M, r, remat, mesh):
    """``(loss, schedule, place, logical)`` for jaxpipe's schedule ``name`` on the model:
    ``place`` turns logical ``[S*r, ...]`` block parameters into the pipeline's layout
    (once, outside the step), ``logical`` turns gradients back."""
    import jax

    from jaxpipe import pipeline

    if name == "1f1b":  # r blocks per stage: params [S*r, ...] -> [S, r, ...]

        def stage_fn(p, x):
            return jax.lax.scan(lambda h, q: (common.block_fn(q, h), None), x, p)[0]

        options, blocks = None, r
    else:
        stage_fn, blocks = common.block_fn, 1
        options = {"circular": {"repeats": r}, "interleaved_1f1b": {"virtual_stages": r}}[name]
    pipe = pipeline.Pipeline(
        stage_fn,
        common.head_loss_fn,
        mesh=mesh,
        schedule=name,
        num_microbatches=M,
        schedule_options=options,
        remat=remat,
    )

    def place(stage_params):
        return pipe.place(
            jax.tree_util.tree_map(lambda p: p.reshape(-1, blocks, *p.shape[1:]), stage_params)
            if blocks > 1
            else stage_params
        )

    def logical(grads):
        return jax.tree_util.tree_map(
            lambda g: g.reshape(-1, *g.shape[1 + (blocks > 1) :]), pipe.logical(grads)
        )

    return pipe.loss, pipe.schedule, place, logical


def block_flops(remats):
    """``{remat: Costs}`` for each ``remat`` in ``remats``: F, B, W and BW of one block, in
    forwards (without remat), from XLA's flop counts of
    the actions as jaxpipe runs them (`jaxpipe.costs.cost_analysis`: B and W are the halves
    of the backward split on its jaxpr). With remat the backward, or each of B and W,
    recomputes the part of the forward it needs."""
    import jax

    from jaxpipe import costs
    from jaxpipe.schedules import Costs

    params, _ = common.init_blocks(jax.random.key(0), 1, WIDTH, HIDDEN)
    params = jax.tree_util.tree_map(lambda a: a[0], params)
    x = jax.ShapeDtypeStruct((ROWS, WIDTH), params["w1"].dtype)
    fns = {False: common.block_fn, True: jax.checkpoint(common.block_fn)}
    flops = {
        r: {k: v["flops"] for k, v in costs.cost_analysis(fns[r], params, x).items()}
        for r in {False, *remats}
    }
    unit = flops[False]["forward"]
    return {r: Costs(**{k: v / unit for k, v in flops[r].items()}) for r in remats}


def compile_step(loss, args):
    import jax

    start = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled, time.perf_counter() - start


def rel_error(got, want):
    import jax
    import jax.numpy as jnp

    errs = jax.tree_util.tree_map(
        lambda a, b: float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30)), got, want
    )
    return max(jax.tree_util.tree_leaves(errs))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-remat", action="store_true", help="skip the remat variants")
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=JAXPIPE_SCHEDULES,
        default=list(JAXPIPE_SCHEDULES),
        help="jaxpipe's schedules to compare with the baseline",
    )
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "maxtext_baseline.json"))
    args = parser.parse_args()

    common.host_devices(8)
    import functools

    import jax

    from jaxpipe.schedules import Costs, simulate

    r = args.repeats
    remats = (False,) if args.no_remat else (False, True)
    block_costs = block_flops(remats)
    for remat, c in block_costs.items():
        print(f"block costs{' with remat' if remat else ''}: {c}")
    began = time.time()
    import memory  # benchmarks/memory.py: collectives in the compiled HLO

    rows, checks = [], []
    for S in args.stages:
        mesh = common.pipe_mesh(S)
        for M in args.microbatches:
            stage, lossp = common.init_blocks(jax.random.key(S * 1000 + M), S * r, WIDTH, HIDDEN)
            x, t = common.block_data(jax.random.key(M), ROWS * M, WIDTH)
            want_loss, want_grads = jax.value_and_grad(
                common.sequential_block_loss, argnums=(0, 1)
            )(stage, lossp, x, t, M)
            cases = []
            for remat in remats:
                base = functools.partial(
                    maxtext_loss,
                    mesh=mesh,
                    num_stages=S,
                    num_microbatches=M,
                    repeats=r,
                    remat=remat,
                )
                baseline = (
                    functools.partial(maxtext_place, mesh=mesh, num_stages=S, repeats=r),
                    maxtext_logical,
                )
                cases.append(("maxtext_baseline", remat, base, maxtext_table(S, M, r), 1, baseline))
                for name in args.schedules:
                    loss, sched, place, logical = jaxpipe_case(name, S, M, r, remat, mesh)
                    blocks = r if name == "1f1b" else 1
                    cases.append((name, remat, loss, sched, blocks, (place, logical)))
            for name, remat, loss, sched, blocks, (place, logical) in cases:
                placed = (place(stage), lossp, x, t)
                compiled, seconds = compile_step(loss, placed)
                got_loss, (got_grads, got_head) = compiled(*placed)
                err = max(
                    abs(float(got_loss) - float(want_loss)) / abs(float(want_loss)),
                    rel_error((logical(got_grads), got_head), want_grads),
                )
                found = memory.collectives(compiled, mesh)
                others = [b for kind, b in found if kind != "collective-permute"]
                checks.append({"case": name, "S": S, "M": M, "remat": remat, "rel_error": err})
                if err > 1e-4:
                    raise AssertionError(f"{name} S={S} M={M} remat={remat}: rel error {err}")
                # a stage of `blocks` blocks costs `blocks` times a block
                c = block_costs[remat]
                costs = Costs(
                    forward=blocks * c.forward,
                    backward_input=blocks * c.backward_input,
                    backward_weight=blocks * c.backward_weight,
                    full_backward=blocks * c.full_backward,
                )
                timeline = simulate(sched, costs, "lockstep")
                rows.append(
                    {
                        "impl": name,
                        "S": S,
                        "M": M,
                        "repeats": r,
                        "remat": remat,
                        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                        "compile_s": seconds,
                        "collective_permutes": sum(k == "collective-permute" for k, _ in found),
                        "other_collectives": len(others),
                        "other_collective_bytes": sum(others),
                        "ticks": sched.num_ticks,
                        "peak_activations_blocks": max(sched.peak_activations()) * blocks,
                        "sim_makespan": timeline.makespan,
                        "sim_bubble": timeline.bubble,
                        "rel_error": err,
                    }
                )
                print(
                    f"  {name:17s} S={S} M={M:3d} remat={remat!s:5s} "
                    f"temp={rows[-1]['temp_bytes'] / 2**20:7.3f} MiB "
                    f"makespan={timeline.makespan:6.0f} err={err:.1e}",
                    flush=True,
                )

    table = []
    for row in rows:
        ref = next(
            q
            for q in rows
            if q["impl"] == "maxtext_baseline"
            and (q["S"], q["M"], q["remat"]) == (row["S"], row["M"], row["remat"])
        )
        row["temp_vs_baseline"] = row["temp_bytes"] / ref["temp_bytes"]
        row["time_vs_baseline"] = row["sim_makespan"] / ref["sim_makespan"]
        table.append(
            [
                row["impl"],
                row["S"],
                row["M"],
                "on" if row["remat"] else "off",
                row["temp_bytes"] / 2**20,
                row["temp_vs_baseline"],
                row["collective_permutes"],
                f"{row['other_collectives']} ({row['other_collective_bytes'] / 1024:.0f} KiB)",
                row["sim_makespan"],
                row["time_vs_baseline"],
                row["sim_bubble"],
                row["rel_error"],
            ]
        )
    common.print_table(
        [
            "impl",
            "S",
            "M",
            "remat",
            "temp MiB",
            "temp/base",
            "permutes",
            "other collectives",
            "sim time",
            "time/base",
            "bubble",
            "rel err",
        ],
        table,
        title=f"MaxText-style circular GPipe vs jaxpipe, model of S*{r} blocks, "
        "simulated time in block forwards (lock-step)",
    )
    meta = common.metadata()
    meta["seconds"] = round(time.time() - began, 1)
    meta["block_costs"] = {str(k): dataclasses.asdict(v) for k, v in block_costs.items()}
    meta["model"] = {
        "blocks": f"S*{r}",
        "width": WIDTH,
        "hidden": HIDDEN,
        "rows_per_microbatch": ROWS,
        "dtype": "float32",
    }
    common.write_json({"meta": meta, "rows": rows, "checks": checks}, args.out)


if __name__ == "__main__":
    main()
