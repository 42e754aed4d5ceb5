"""jaxpipe's own cost on one GPU: a 1-stage pipeline against plain gradient accumulation.

For a lent H100/H200 (see /work/.library/device/README.md): one script that does
everything and writes JSON to ``$OUT`` (or ``--out``). Measured, per configuration of a
GPT-style block stack in bf16 (pre-norm causal self-attention + 4x GELU MLP, L layers):

- ``plain``: ``jit(grad)`` of a ``lax.scan`` over M micro-batches, each step ``jax.grad`` of
  the micro-batch loss added to the accumulated gradients (the ordinary JAX loop);
- ``plain+cond``: the same with each step inside a ``lax.cond`` on a runtime flag (always
  true): the cost of skipping idle work with ``cond``;
- ``plain+mask``: each step always computed and its gradient added through ``jnp.where`` on
  the flag: the cost of computing-and-masking instead;
- ``jaxpipe``: ``jit(grad(pipe.loss))`` with a mesh of one device (S=1), the whole stack in
  the one stage, ``1f1b`` with M micro-batches (``--remat`` adds the remat variant);

as median step time, model TFLOP/s (``3 * tokens * L * (24 d^2 + 4 T d)``: forward and
backward of the matmuls, attention counted in full), MFU against the device's dense bf16
peak, and the ratio to ``plain``. jaxpipe's target is within 3% of ``plain``.

Unless ``--skip-concurrency``, it then runs ``benchmarks/concurrency.py`` on the machine's
CPU cores (16 on the lent machines) with host devices and writes its JSON next to this one.

    python benchmarks/gpu_overhead.py                 # on the GPU machine: OUT=... set
    python benchmarks/gpu_overhead.py --small         # CPU smoke check (seconds)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import common

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense, SXM datasheets

CONFIGS = [  # (width, layers, heads, seq, rows per micro-batch, micro-batches)
    (1024, 8, 16, 1024, 4, 8),
    (1024, 8, 16, 1024, 4, 64),
    (4096, 4, 32, 1024, 2, 8),
    (4096, 4, 32, 1024, 2, 64),
]
SMALL = [(64, 2, 4, 16, 2, 2), (64, 2, 4, 16, 2, 8)]


def init(key, layers, width, dtype):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(key, 4)

    def dense(key, shape):
        return (jax.random.normal(key, (layers, *shape)) / jnp.sqrt(shape[0])).astype(dtype)

    return {
        "ln1": jnp.ones((layers, width), dtype),
        "ln2": jnp.ones((layers, width), dtype),
        "qkv": dense(k[0], (width, 3 * width)),
        "out": dense(k[1], (width, width)),
        "up": dense(k[2], (width, 4 * width)),
        "down": dense(k[3], (4 * width, width)),
    }


def make_block(heads):
    import jax
    import jax.numpy as jnp

    def norm(x, scale):
        x32 = x.astype(jnp.float32)
        x32 = (x32 - x32.mean(-1, keepdims=True)) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + 1e-5)
        return (x32 * scale.astype(jnp.float32)).astype(x.dtype)

    def block(p, x):  # x [B, T, D]
        B, T, D = x.shape
        q, k, v = jnp.split(norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(B, T, heads, D // heads) for a in (q, k, v))
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, D)
        x = x + a @ p["out"]
        return x + jax.nn.gelu(norm(x, p["ln2"]) @ p["up"]) @ p["down"]

    def stack(params, x):
        return jax.lax.scan(lambda h, p: (block(p, h), None), x, params)[0]

    return stack


def loss_fn(lp, y, target):
    import jax.numpy as jnp

    return jnp.mean((y.astype(jnp.float32) * lp["scale"] - target.astype(jnp.float32)) ** 2)


def timed(fn, args, repeats):
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, first


def run_config(cfg, args, device):
    import jax
    import jax.numpy as jnp

    from jaxpipe import pipeline
    from jaxpipe.pipeline import split_microbatches

    width, layers, heads, seq, rows, M = cfg
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    stack = make_block(heads)
    params = init(jax.random.key(0), layers, width, dtype)
    lp = {"scale": jnp.ones((), jnp.float32)}
    batch = rows * M
    kx, kt = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (batch, seq, width), dtype)
    t = jax.random.normal(kt, (batch, seq, width), dtype)
    params, lp, x, t = jax.device_put((params, lp, x, t), device)
    active = jax.device_put(jnp.ones((M,), bool), device)

    def mb_loss(p, lp, xm, tm):
        return loss_fn(lp, stack(p, xm), tm)

    def accumulate(p, lp, x, t, flags, mode):
        xs, ts = split_microbatches(x, M), split_microbatches(t, M)
        zero = jax.tree_util.tree_map(jnp.zeros_like, (p, lp))

        def step(acc, item):
            xm, tm, flag = item

            def compute():
                loss, g = jax.value_and_grad(mb_loss, argnums=(0, 1))(p, lp, xm, tm)
                return loss, g

            if mode == "plain+cond":
                loss, g = jax.lax.cond(flag, compute, lambda: (jnp.zeros((), jnp.float32), zero))
            else:
                loss, g = compute()
                if mode == "plain+mask":
                    g = jax.tree_util.tree_map(lambda a: jnp.where(flag, a, 0), g)
            acc = jax.tree_util.tree_map(lambda a, b: a + b.astype(a.dtype), acc, g)
            return acc, loss

        grads, losses = jax.lax.scan(step, zero, (xs, ts, flags))
        grads = jax.tree_util.tree_map(lambda g: (g / M).astype(g.dtype), grads)
        return jnp.mean(losses), grads

    variants = {}
    for mode in ("plain", "plain+cond", "plain+mask"):
        variants[mode] = (
            jax.jit(lambda p, lp, x, t, f, mode=mode: accumulate(p, lp, x, t, f, mode)),
            (params, lp, x, t, active),
        )

    mesh = jax.make_mesh(
        (1,), ("pipe",), axis_types=(jax.sharding.AxisType.Auto,), devices=[device]
    )
    stage_params = jax.tree_util.tree_map(lambda a: a[None], params)  # S*v = 1
    for remat in (False, True) if args.remat else (False,):
        pipe = pipeline.Pipeline(
            stack, loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=M, remat=remat
        )
        name = "jaxpipe+remat" if remat else "jaxpipe"
        variants[name] = (
            jax.jit(jax.value_and_grad(pipe.loss, argnums=(0, 1))),
            (stage_params, lp, x, t),
        )

    flops = 3 * batch * seq * layers * (24 * width**2 + 4 * seq * width)
    peak = args.peak_tflops or next(
        (v for k, v in PEAK_BF16_TFLOPS.items() if k in device.device_kind), None
    )
    results, losses, grad_diff = {}, {}, {}
    plain_grads = None
    for name, (fn, fargs) in variants.items():
        median, raw, first = timed(fn, fargs, args.repeats)
        loss, (g_stage, g_loss) = fn(*fargs)
        losses[name] = float(loss)
        if name.startswith("jaxpipe"):  # stage axis of length S*v = 1
            g_stage = jax.tree_util.tree_map(lambda a: a[0], g_stage)
        if plain_grads is None:
            plain_grads = g_stage
        diffs = jax.tree_util.tree_map(
            lambda a, b: float(
                jnp.linalg.norm((a - b).astype(jnp.float32))
                / (jnp.linalg.norm(b.astype(jnp.float32)) + 1e-30)
            ),
            g_stage,
            plain_grads,
        )
        grad_diff[name] = max(jax.tree_util.tree_leaves(diffs))
        tflops = flops / median / 1e12
        results[name] = {
            "median_s": median,
            "raw_s": raw,
            "first_call_s": first,
            "tflops": tflops,
            "mfu": tflops / peak if peak else None,
        }
    base = results["plain"]["median_s"]
    for r in results.values():
        r["time_vs_plain"] = r["median_s"] / base
    ref = losses["plain"]
    return {
        "width": width,
        "layers": layers,
        "heads": heads,
        "seq": seq,
        "rows_per_microbatch": rows,
        "microbatches": M,
        "dtype": args.dtype,
        "model_flops_per_step": flops,
        "peak_tflops": peak,
        "results": results,
        "losses": losses,
        "max_loss_rel_diff": max(abs(v - ref) / abs(ref) for v in losses.values()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes: a CPU smoke check")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--remat", action="store_true", help="also jaxpipe with remat=True")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument(
        "--config",
        type=int,
        nargs=6,
        action="append",
        metavar=("WIDTH", "LAYERS", "HEADS", "SEQ", "ROWS", "M"),
    )
    parser.add_argument("--skip-concurrency", action="store_true")
    parser.add_argument(
        "--out",
        default=None,
        help="JSON path; default $OUT/gpu_overhead.json, else benchmarks/results/gpu_overhead.json",
    )
    args = parser.parse_args()
    out = args.out or os.path.join(os.environ.get("OUT") or common.RESULTS, "gpu_overhead.json")
    configs = args.config or (SMALL if args.small else CONFIGS)
    args.repeats = args.repeats or (2 if args.small else 10)

    import jax

    device = jax.devices()[0]
    print(
        f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True
    )
    if not args.small and jax.default_backend() == "cpu":
        print("WARNING: no accelerator found; absolute numbers from a CPU mean nothing here")
    began = time.time()
    rows = []
    for cfg in configs:
        print(
            f"config width={cfg[0]} layers={cfg[1]} heads={cfg[2]} seq={cfg[3]} "
            f"rows={cfg[4]} M={cfg[5]}",
            flush=True,
        )
        rows.append(run_config(tuple(cfg), args, device))
        for name, r in rows[-1]["results"].items():
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
            print(
                f"  {name:14s} {1e3 * r['median_s']:9.2f} ms  {r['tflops']:8.2f} TFLOP/s  "
                f"MFU {mfu:>6s}  x{r['time_vs_plain']:.3f} of plain",
                flush=True,
            )

    table = []
    for row in rows:
        for name, r in row["results"].items():
            table.append(
                [
                    row["width"],
                    row["layers"],
                    row["microbatches"],
                    name,
                    1e3 * r["median_s"],
                    r["tflops"],
                    100 * r["mfu"] if r["mfu"] else float("nan"),
                    r["time_vs_plain"],
                ]
            )
    common.print_table(
        ["width", "layers", "M", "variant", "ms", "TFLOP/s", "MFU %", "time/plain"],
        table,
        title="One-stage jaxpipe vs plain accumulation",
    )
    meta = common.metadata()
    meta["seconds"] = round(time.time() - began, 1)
    meta["small"] = args.small
    common.write_json({"meta": meta, "rows": rows}, out)

    if not args.skip_concurrency:
        cmd = [
            sys.executable,
            os.path.join(common.ROOT, "benchmarks", "concurrency.py"),
            "--out",
            os.path.join(os.path.dirname(out), "concurrency.json"),
        ]
        if args.small:
            cmd += ["--microbatches", "8", "--repeats", "2", "--width", "32", "--rows", "8"]
        else:
            cmd += ["--width", "512", "--rows", "128", "--repeats", "10"]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("XLA_FLAGS", None)
        print("\nrunning", " ".join(cmd), flush=True)
        subprocess.run(cmd, env=env, check=False)


if __name__ == "__main__":
    main()
