"""Helpers shared by the benchmark scripts: run metadata, JSON output, a small stage model.

Not part of the library. Every script puts the repository root on ``sys.path`` so it runs
as ``python benchmarks/<name>.py`` from a plain checkout.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
IMAGES = os.path.join(ROOT, "docs", "img")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def host_devices(count: int = 8, extra_flags: str = "") -> None:
    """Asks XLA for ``count`` CPU host devices; call before importing jax."""
    if "jax" in sys.modules:
        raise RuntimeError("host_devices() must run before jax is imported")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={count}"
    os.environ["XLA_FLAGS"] = (flags + " " + extra_flags).strip()


def metadata() -> dict:
    """Where and when a run happened: date, machine, versions, XLA flags."""
    import jax

    devices = jax.devices()
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": getattr(__import__("jaxlib"), "__version__", "?"),
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "num_devices": len(devices),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        **library_state(),
    }


def library_state() -> dict:
    """The library the numbers came from: git HEAD, files changed since, a content hash."""
    import glob
    import hashlib
    import subprocess

    def git(*cmd):
        try:
            return subprocess.run(
                ["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(ROOT, "jaxpipe", "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, ROOT).encode() + b"\0" + f.read())
    status = git("status", "--porcelain", "--", "jaxpipe")
    return {
        "git_head": git("rev-parse", "HEAD"),
        "jaxpipe_changed_since_head": status.splitlines() if status else [],
        "jaxpipe_sha256": digest.hexdigest()[:16],
    }


def write_json(data: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False, default=str)
        f.write("\n")
    print(f"wrote {os.path.relpath(path)}")
    return path


def print_table(header: list[str], rows: list[list], title: str | None = None) -> None:
    """A plain fixed-width table on stdout."""

    def fmt(x):
        if isinstance(x, float):
            return f"{x:.4g}"
        return str(x)

    cells = [[fmt(x) for x in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)
    ]
    if title:
        print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=False)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=False)))


# --------------------------------------------------------------------------- the model
# A transformer-ish block without attention: x + W2 gelu(W1 layernorm(x) + b1) + b2 on
# [tokens, width] micro-batches. Shape and dtype preserving, as a pipeline stage must be.


def block_fn(p, x):
    import jax
    import jax.numpy as jnp

    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["shift"]
    h = jax.nn.gelu(h @ p["w1"] + p["b1"])
    return x + h @ p["w2"] + p["b2"]


def head_loss_fn(lp, y, target):
    import jax.numpy as jnp

    return jnp.mean((y @ lp["head"] - target) ** 2)


def init_blocks(key, num_stages: int, width: int, hidden: int | None = None, out: int = 8):
    """Stage params with a leading stage axis (distinct per stage) and head params."""
    import jax
    import jax.numpy as jnp

    hidden = hidden or 4 * width
    k = jax.random.split(key, 6)
    stage = {
        "scale": 1.0 + 0.1 * jax.random.normal(k[0], (num_stages, width)),
        "shift": 0.1 * jax.random.normal(k[1], (num_stages, width)),
        "w1": jax.random.normal(k[2], (num_stages, width, hidden)) / jnp.sqrt(width),
        "b1": 0.1 * jax.random.normal(k[3], (num_stages, hidden)),
        "w2": jax.random.normal(k[4], (num_stages, hidden, width)) / jnp.sqrt(hidden),
        "b2": jnp.zeros((num_stages, width)),
    }
    loss = {"head": jax.random.normal(k[5], (width, out)) / jnp.sqrt(width)}
    return stage, loss


def block_data(key, batch: int, width: int, out: int = 8):
    import jax

    kx, kt = jax.random.split(key)
    return jax.random.normal(kx, (batch, width)), jax.random.normal(kt, (batch, out))


def sequential_block_loss(stage_params, loss_params, inputs, targets, num_microbatches):
    """Reference: stages one after another, mean of the loss over micro-batches (as jaxpipe
    splits them: micro-batch m is the m-th block of B / M rows)."""
    import jax
    import jax.numpy as jnp

    from jaxpipe.pipeline import split_microbatches

    xs = split_microbatches(inputs, num_microbatches)
    ts = split_microbatches(targets, num_microbatches)

    def one(x, t):
        def layer(h, p):
            return block_fn(p, h), None

        h, _ = jax.lax.scan(layer, x, stage_params)
        return head_loss_fn(loss_params, h, t)

    return jnp.mean(jax.vmap(one)(xs, ts))


def pipe_mesh(num_stages: int):
    import jax

    return jax.make_mesh(
        (num_stages,),
        ("pipe",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:num_stages],
    )


SCHEDULE_OPTIONS = {"interleaved_1f1b": {"virtual_stages": 2}, "circular": {"repeats": 2}}
NOT_EXECUTED = ("pipedream", "pipedream_2bw")  # need the optimizer inside the pipeline


def one_f_one_b_fused(num_stages: int, num_microbatches: int):
    """A proposal, not in the library: 1F1B whose steady state runs one forward and one
    full backward in the *same* tick (a two-action cell, as `dualpipev` uses).

    Device ``d`` runs ``2(S-d)-1`` warm-up forwards (the round trip of a lock-step tick
    needs two ticks per stage), then ``(F, BW)`` pairs, then drains. In lock-step every
    steady tick then costs F + BW on every device, so the lock-step bubble equals the
    ideal one; the price is up to ``2S`` activations on device 0 instead of ``S``.
    """
    from jaxpipe.schedules import BW, Action, F, pack, validate

    S, M = num_stages, num_microbatches
    orders = []
    for d in range(S):
        warmup = min(2 * (S - d) - 1, M)
        order = [Action(F, d, m) for m in range(warmup)]
        order += [(Action(F, d, warmup + m), Action(BW, d, m)) for m in range(M - warmup)]
        order += [Action(BW, d, m) for m in range(M - warmup, M)]
        orders.append(order)
    return validate(pack("1f1b_fused", S, M, list(range(S)), orders, max_actions_per_tick=2))
