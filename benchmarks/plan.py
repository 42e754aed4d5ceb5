"""jaxpipe.plan on transformer models and targets: the plans it ranks, and (with
``--exhaustive``) every candidate of a small space compiled, to hold its choice against.

    python3 benchmarks/plan.py --model llama3-70b --target v5p:4x4x8
    python3 benchmarks/plan.py --model tiny --target v5p:2x2x1 --exhaustive
    python3 benchmarks/plan.py --model llama2-70b --target v5p:4x4x4 --attention splash

The plans are compiled with each stage's blocks in a Python loop
(``jaxpipe.stages.blocks(block)``); ``--scan`` compiles them in a ``lax.scan``.

``--attention splash`` runs attention in splash, the Pallas TPU kernel MaxText runs, and
gives the planner the kernel's FLOPs (`jaxpipe.analysis.kernels`), which the compiler's
estimate of a block does not see.

Prints the ranked plans and writes JSON (``--out``, default
``benchmarks/results/plan_<model>_<target>.json``): the plans, the search's seconds, and
with ``--exhaustive`` the best compiled step of the whole space against the plan's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jaxpipe

jaxpipe._quiet.import_jax()  # without the CUDA plugin's lines on a machine without a GPU
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpipe.analysis import kernels  # noqa: E402

# name -> (blocks, width, heads, kv heads, hidden, vocabulary, rows, tokens a row)
MODELS = {
    "tiny": (8, 256, 4, 2, 704, 512, 16, 128),
    "gpt-small": (12, 768, 12, 12, 3072, 50304, 64, 1024),
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 128, 8192),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 128, 8192),
    # MaxText's published Llama-2-70B run on 64 v5p chips: 4 rows of 4096 tokens a chip
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000, 256, 4096),
    # Megatron-LM's published 70B run on H100s, one data-parallel replica's rows (8 of 4096
    # tokens on 16 GPUs); SwiGLU of the same parameters as its GELU MLP of 4 x width
    "megatron-70b": (84, 8192, 64, 64, 21848, 131072, 8, 4096),
    # and its 119B run (16 rows of 4096 tokens on 32 GPUs a replica), the same way
    "megatron-119b": (92, 10240, 80, 80, 27312, 131072, 16, 4096),
    # MaxText's published 32B and 64B runs on 64 v5p chips (8 and 4 rows of 2048 tokens a
    # chip): heads of 256, and a ReLU MLP of one up projection (benchmarks/published_runs.py)
    "maxtext-32b": (32, 10240, 32, 32, 32768, 32768, 512, 2048),
    "maxtext-64b": (64, 10240, 32, 32, 32768, 32768, 256, 2048),
}
HEAD_DIM = {"maxtext-32b": 256, "maxtext-64b": 256}  # name -> width of a head; else 128
RELU_MLP = {"maxtext-32b", "maxtext-64b"}


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + 1e-6) * scale).astype(x.dtype)


def splash(q, k, v):
    """Causal attention in splash, the Pallas TPU kernel, on each device's rows and heads
    (XLA does not split a kernel's call: it runs under a shard_map over the mesh axes still
    automatic inside the pipeline's stage, rows over data and fsdp, heads over tensor)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    def one_device(q, k, v):
        rows, tokens, heads, head_dim = q.shape
        b = kernels.tile_for("splash", tokens)
        sizes = sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                              block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b,
                              block_kv_dq=b)  # fmt: skip
        mask = sa.MultiHeadMask([sa.CausalMask((tokens, tokens))] * heads)
        kernel = sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)
        q = q * jnp.asarray(head_dim**-0.5, q.dtype)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        return jax.vmap(kernel)(q, k, v).transpose(0, 2, 1, 3)

    mesh = jax.sharding.get_abstract_mesh()
    automatic = [] if mesh.empty else [
        a for a, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind != jax.sharding.AxisType.Manual]  # fmt: skip
    if not automatic:
        return one_device(q, k, v)
    rows = tuple(a for a in ("data", "fsdp") if a in automatic) or None
    spec = P(rows, None, "tensor" if "tensor" in automatic else None, None)
    return jax.shard_map(
        one_device, in_specs=(spec, spec, spec), out_specs=spec,
        axis_names=frozenset(automatic), check_vma=False,
    )(q, k, v)  # fmt: skip


ATTENTION = {
    "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    "splash": splash,
}


def block(p, x, attention="xla", head_dim=128):
    """A Llama block: grouped-query causal attention (XLA's, or splash) and a SwiGLU MLP
    (a ReLU MLP where ``p`` has no ``w_gate``), each behind an RMS norm and a residual."""
    rows, tokens, _ = x.shape
    h = rms_norm(x, p["attn_norm"])
    q = (h @ p["wq"]).reshape(rows, tokens, -1, head_dim)
    k = (h @ p["wk"]).reshape(rows, tokens, -1, head_dim)
    v = (h @ p["wv"]).reshape(rows, tokens, -1, head_dim)
    o = ATTENTION[attention](q, k, v).reshape(rows, tokens, -1)
    x = x + o @ p["wo"]
    h = rms_norm(x, p["mlp_norm"])
    if "w_gate" not in p:
        return x + jax.nn.relu(h @ p["w_up"]) @ p["w_down"]
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def loss(head, y, labels):
    logits = (rms_norm(y, head["norm"]) @ head["out"]).astype(jnp.float32)
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)
    return -jnp.mean(picked)


def model(name: str, dtype=jnp.bfloat16, rows=None):
    """(num_blocks, block params, block specs, head, head specs, inputs, targets)."""
    L, D, H, KV, F, V, default_rows, T = MODELS[name]
    rows = rows or default_rows
    hd = HEAD_DIM.get(name, 128)
    s = jax.ShapeDtypeStruct
    params = {
        "attn_norm": s((D,), dtype), "wq": s((D, H * hd), dtype), "wk": s((D, KV * hd), dtype),
        "wv": s((D, KV * hd), dtype), "wo": s((H * hd, D), dtype), "mlp_norm": s((D,), dtype),
        "w_gate": s((D, F), dtype), "w_up": s((D, F), dtype), "w_down": s((F, D), dtype),
    }  # fmt: skip
    if name in RELU_MLP:
        del params["w_gate"]
    column, row = P("fsdp", "tensor"), P("tensor", "fsdp")
    specs = {"attn_norm": P(), "wq": column, "wk": column, "wv": column, "wo": row,
             "mlp_norm": P(), "w_gate": column, "w_up": column, "w_down": row}  # fmt: skip
    specs = {k: v for k, v in specs.items() if k in params}
    head = {"norm": s((D,), dtype), "out": s((D, V), dtype)}
    head_specs = {"norm": P(), "out": P(None, ("tensor", "fsdp"))}
    return (L, params, specs, head, head_specs, s((rows, T, D), dtype),
            s((rows, T), jnp.int32))  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=list(MODELS))
    parser.add_argument("--target", default="v5p:2x2x1")
    parser.add_argument("--compile-top", type=int, default=3)
    parser.add_argument(
        "--rows", type=int, default=None, help="rows of a step (default: the model's)"
    )
    parser.add_argument("--budget-gib", type=float, default=None, help="memory a device may hold")
    parser.add_argument("--schedules", nargs="*", default=None)
    parser.add_argument("--microbatches", nargs="*", type=int, default=None)
    parser.add_argument("--remats", nargs="*", default=None, help="names of planner.REMATS")
    parser.add_argument("--gathers", nargs="*", default=None, help="names of planner.GATHERS")
    parser.add_argument(
        "--fixed", nargs="*", default=(), help="axis sizes to keep, e.g. pipe=8 tensor=2"
    )
    parser.add_argument(
        "--exhaustive", action="store_true", help="also compile every fitting candidate"
    )
    parser.add_argument(
        "--attention", default="xla", choices=list(ATTENTION), help="splash: TPU targets only"
    )
    parser.add_argument(
        "--scan", action="store_true", help="compile a stage's blocks in a lax.scan, not a loop"
    )
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    target = jaxpipe.target.get(args.target)
    L, params, specs, head, head_specs, inputs, targets = model(args.model, rows=args.rows)
    options = dict(
        block_specs=specs, loss_specs=head_specs, target=target,
        memory_budget=None if args.budget_gib is None else int(args.budget_gib * 2**30),
        **({"schedules": args.schedules} if args.schedules else {}),
        **({"microbatches": args.microbatches} if args.microbatches else {}),
        **({"remats": args.remats} if args.remats else {}),
        **({"gathers": args.gathers} if args.gathers else {}),
        fixed={axis: int(n) for axis, n in (f.split("=") for f in args.fixed)},
        scan_blocks=args.scan,
    )  # fmt: skip
    head_dim = HEAD_DIM.get(args.model, 128)
    block_fn = functools.partial(block, attention=args.attention, head_dim=head_dim)
    if args.attention == "splash":
        _, _, heads, _, _, _, _, tokens = MODELS[args.model]
        options["kernel_flops"] = kernels.attention_flops(
            "splash", rows=1, seq=tokens, heads=heads, head_dim=head_dim
        )
    start = time.perf_counter()
    plans = jaxpipe.plan(block_fn, params, L, loss, head, inputs, targets,
                         compile_top=args.compile_top, log=print, **options)  # fmt: skip
    seconds = time.perf_counter() - start
    print(plans)
    print(f"\nsearched in {seconds:.0f} s; the plan:\n{plans[0]}")
    result = {"model": args.model, "target": args.target, "attention": args.attention,
              "stage": "scan" if args.scan else "loop", "seconds": seconds,
              "plans": [p.as_dict() for p in plans[:20]]}  # fmt: skip
    if args.exhaustive:
        start = time.perf_counter()
        every = jaxpipe.plan(block_fn, params, L, loss, head, inputs, targets, compile_top=10**6,
                             **options)  # fmt: skip
        compiled = [p for p in every if p.compiled]
        best = min(compiled, key=lambda p: p.step_seconds)
        gap = plans[0].step_seconds / best.step_seconds - 1
        print(f"\nexhaustive: {len(compiled)} plans compiled in {time.perf_counter() - start:.0f}"
              f" s; best {best.step_seconds * 1e3:.2f} ms ({best.describe()}); the plan's "
              f"{plans[0].step_seconds * 1e3:.2f} ms, {gap:+.1%}")  # fmt: skip
        result["exhaustive"] = {"compiled": len(compiled), "best": best.as_dict(), "gap": gap}
    name = f"plan_{args.model}_{args.target.replace(':', '-')}.json"
    if args.attention != "xla":
        name = name.replace(".json", f"_{args.attention}.json")
    path = args.out or os.path.join(os.path.dirname(__file__), "results", name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
