"""Calibrate jaxpipe's step-time model on published, measured training runs.

Each run of `published_runs.RUNS` that MaxText published for a TPU is compiled here, with
MaxText's own ``train_compile`` for the run's topology and settings (`maxtext_compile.py`),
three times: as published (memory and collectives: `jaxpipe.target`'s report) and with its
layers written out at one and at two layers, whose difference is the compiler's estimate
of one layer (the TPU compiler's cost analysis counts a loop's body once). The compiler's
estimate of the whole step is then ``step(1) + (layers - 1) * (step(2) - step(1))``.

    # once: an environment with MaxText (it pins its own jax; keep it apart from jaxpipe's)
    python3.13 -m venv maxtext-env
    maxtext-env/bin/pip install "jax[tpu]==0.12.0.1" flax==0.12.12 optax==0.2.8
    maxtext-env/bin/pip install --no-deps maxtext==0.2.5 aqtp qwix
    maxtext-env/bin/pip install omegaconf packaging pathwaysutils jinja2 tokamax \\
        huggingface_hub transformers grain drjax pillow tiktoken sentencepiece==0.2.1 sympy \\
        orbax-checkpoint tensorboardX
    # compile every TPU run (minutes each; results are kept and reused)
    python3 benchmarks/calibration.py compile --maxtext-python maxtext-env/bin/python
    # fit the model and write benchmarks/results/calibration.json
    python3 benchmarks/calibration.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import published_runs

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILED = os.path.join(HERE, "results", "calibration")
VARIANTS = {  # name -> MaxText overrides added to the run's own
    "full": (),
    "layers1": ("override_model_config=true", "base_num_decoder_layers=1", "scan_layers=false"),
    "layers2": ("override_model_config=true", "base_num_decoder_layers=2", "scan_layers=false"),
}


COMPUTE_CHIPS = 64  # where a run is FSDP alone, its layer variants compile on this many


def compile_topology(run: published_runs.PublishedRun, variant: str = "full") -> tuple[str, str]:
    """(MaxText's ``compile_topology``, jaxpipe's target name) for ``run``'s ``variant``.

    MaxText names a slice as Cloud TPU does: by TensorCores on v5p (two a chip), by chips
    on v5e and v6e. The published program (``"full"``) compiles for the run's own chips. The
    layer variants give only the computation, which a device of a run split by FSDP alone
    does the same on any number of chips (its rows, and each layer's weights once gathered,
    do not change): those compile for `COMPUTE_CHIPS` chips, minutes sooner."""
    chips, name = run.chips, run.topology
    pure_fsdp = all(size == 1 for axis, size in run.mesh.items() if axis != "fsdp")
    if variant != "full" and pure_fsdp and chips > COMPUTE_CHIPS:
        chips = COMPUTE_CHIPS
        name = {"v5p": "v5p:4x4x4", "v5e": "v5e:8x8", "v6e": "v6e:8x8"}[run.chip]
    cores = {"v5p": 2, "v5e": 1, "v6e": 1}[run.chip]
    return f"{run.chip}-{cores * chips}", name


def compiled_path(run: published_runs.PublishedRun, variant: str) -> str:
    return os.path.join(COMPILED, f"{run.name}.{variant}.json")


def maxtext_runs() -> list[published_runs.PublishedRun]:
    """The runs MaxText published for a TPU, with settings today's MaxText takes."""
    return [r for r in published_runs.RUNS if r.maxtext_config and r.topology]


def compile_run(python: str, run: published_runs.PublishedRun, variant: str) -> dict:
    """Compiles ``run`` (``variant`` of `VARIANTS`) with MaxText in ``python``'s environment;
    as published, with the run's XLA options and, where this compiler refuses them, without
    (said in the result's ``xla_flags``). Returns the result written to `compiled_path`."""
    topology, target = compile_topology(run, variant)
    base = [
        f"compile_topology={topology}",
        "compile_topology_num_slices=1",
        "dataset_type=synthetic",
        "enable_checkpointing=false",
        *run.maxtext_config.split(),
        *VARIANTS[variant],
    ]
    path = compiled_path(run, variant)
    os.makedirs(COMPILED, exist_ok=True)
    script = os.path.join(HERE, "maxtext_compile.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    # The layer variants give the computation alone, which the collective options leave be.
    flags = run.libtpu_init_args() if variant == "full" else ""
    attempts = [(flags, [f"compile_xla_flags={flags}"])] if flags else []
    attempts.append(("", []))
    errors = []
    for used, extra in attempts:
        cmd = [python, script, "--target", target, "--out", path, *base, *extra]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=COMPILED)
        if done.returncode == 0:
            with open(path, encoding="utf-8") as f:
                result = json.load(f)
            result["xla_flags"] = used
            result["xla_flags_refused"] = errors
            with open(path, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
            return result
        errors.append(done.stderr.strip().splitlines()[-1:] or ["(no message)"])
    raise RuntimeError(f"{run.name} ({variant}) did not compile: {errors}")


def compile_all(python: str, names=None, variants=tuple(VARIANTS)) -> None:
    for run in maxtext_runs():
        if names and run.name not in names:
            continue
        for variant in variants:
            if os.path.exists(compiled_path(run, variant)):
                continue
            print(f"compiling {run.name} ({variant}) ...", flush=True)
            try:
                result = compile_run(python, run, variant)
            except RuntimeError as error:
                print(f"  {error}", flush=True)
                continue
            print(f"  {result['compile_seconds']:.0f} s; flags: {result['xla_flags'] or 'none'}")


# ------------------------------------------------------------------ the published step
CAUSAL_HALF = {  # does the run's FLOP convention count causal attention at half?
    published_runs.MAXTEXT_2025: True,
    published_runs.MAXTEXT_2023_DEC: True,
    published_runs.MAXTEXT_2023_OCT: False,
    published_runs.MEGATRON_2024: False,
}


def model_flops_per_chip(run: published_runs.PublishedRun, causal_half: bool) -> float:
    """The model's FLOPs in one step per chip (MaxText's count, `published_runs.MAXTEXT_2025`):
    three times the forward's matrix products (weights and logits) and attention's two
    products, at half for causal attention where ``causal_half``; recomputation not
    counted."""
    m = run.model
    matrices = 3 if m["activation"] == "swiglu" else 2
    per_token = (
        m["layers"]
        * (
            2 * m["width"] * (m["heads"] + 2 * m["kv_heads"]) * m["head_dim"]
            + 2 * m["width"] * m["heads"] * m["head_dim"]
            + 2 * m["width"] * m["hidden"] * matrices
        )
        + 2 * m["width"] * m["vocab"]
    )
    attention = 4 * run.seq * m["heads"] * m["head_dim"] * m["layers"] / (2 if causal_half else 1)
    tokens = run.per_device_batch * run.seq
    return 3 * tokens * (per_token + attention)


def published_step_seconds(run: published_runs.PublishedRun) -> tuple[float, str]:
    """The run's measured step time and how it follows from what was published: from
    tokens per second where given (no FLOP convention involved), else from TFLOP/s per chip
    and the source's own FLOP count."""
    tokens = run.per_device_batch * run.seq
    if run.tokens_per_second_per_chip:
        return tokens / run.tokens_per_second_per_chip, (
            f"{tokens:.0f} tokens a chip / {run.tokens_per_second_per_chip} tokens/s a chip"
        )
    half = CAUSAL_HALF[run.flops_convention]
    flops = model_flops_per_chip(run, half)
    return flops / (run.tflops_per_chip * 1e12), (
        f"{flops:.4g} FLOPs a chip ({'causal attention at half' if half else 'attention in full'}"
        f", the source's count) / {run.tflops_per_chip} TFLOP/s a chip"
    )


# ------------------------------------------------------------------ the compiled step
def load(run, variant) -> dict | None:
    path = compiled_path(run, variant)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def compiler_step(run) -> dict | None:
    """The compiler's estimate of the whole step: its ``optimal_seconds`` (and FLOPs) of
    the step written out at one and at two layers, extended linearly to the run's layers."""
    one, two = load(run, "layers1"), load(run, "layers2")
    if one is None or two is None:
        return None
    layers = run.model["layers"]
    out = {}
    for key in ("optimal_seconds", "flops"):
        a, b = one["cost"][key], two["cost"][key]
        out[key] = a + (layers - 1) * (b - a)
        out[f"{key}_per_layer"] = b - a
    return out


def exposed_step(run) -> dict | None:
    """Communication the published program's schedule leaves exposed (not behind
    computation), at the target's link bandwidths: once-a-step and in-loop (x trips)."""
    full = load(run, "full")
    if full is None:
        return None
    report = full["report"]
    loop = full["exposed_loop_seconds"] or 0.0
    trips = full["loop_trips"] or 0
    return {
        "seconds": (full["exposed_step_seconds"] or 0.0) + trips * loop,
        "fits": report["fits"],
        "needed_gib": report["needed_bytes"] / 2**30,
        "capacity_gib": (report["capacity_bytes"] or 0) / 2**30,
        "xla_flags": full.get("xla_flags", ""),
    }


# ------------------------------------------------------------------ the model and its fit
MODELS = {  # name -> (what it charges, predicted step from (compute, exposed, scale))
    "compute": (
        "the compiler's estimate of the computation x scale; collectives hidden",
        lambda compute, exposed, scale: scale * compute,
    ),
    "compute+exposed": (
        "the compiler's estimate of the computation x scale, plus the collectives its "
        "schedule leaves exposed at one link's one-way bandwidth",
        lambda compute, exposed, scale: scale * compute + exposed,
    ),
}


def fit_scale(rows, model: str) -> float:
    """The one ``scale`` of ``model`` that best fits ``rows`` (least squares of the log of
    predicted over published: every row weighs the same, whatever its step time)."""
    import math

    predict = MODELS[model][1]
    # log(predicted / published) is monotone in the scale: bisect on its mean
    lo, hi = 1e-3, 1e3
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        mean = sum(
            math.log(predict(r["compute"], r["exposed"], mid) / r["published"]) for r in rows
        )
        lo, hi = (mid, hi) if mean < 0 else (lo, mid)
    return math.sqrt(lo * hi)


def evaluate(rows, model: str) -> dict:
    """``scale`` fitted on every row, each row's error in and out of sample (the scale
    fitted without it: leave one out)."""
    predict = MODELS[model][1]
    scale = fit_scale(rows, model)
    out = {"model": model, "charges": MODELS[model][0], "scale": scale, "rows": {}}
    for r in rows:
        others = [o for o in rows if o is not r]
        held = fit_scale(others, model) if others else float("nan")
        out["rows"][r["name"]] = {
            "predicted": predict(r["compute"], r["exposed"], scale),
            "error": predict(r["compute"], r["exposed"], scale) / r["published"] - 1,
            "held_out_scale": held,
            "held_out_predicted": predict(r["compute"], r["exposed"], held),
            "held_out_error": predict(r["compute"], r["exposed"], held) / r["published"] - 1,
        }
    out["worst_error"] = max(abs(v["error"]) for v in out["rows"].values())
    out["worst_held_out_error"] = max(abs(v["held_out_error"]) for v in out["rows"].values())
    return out


def tpu_rows() -> list[dict]:
    """Per MaxText TPU run compiled here: the published step, the compiler's estimate of
    its computation, the exposed communication, and what they say about each other."""
    from jaxpipe.analysis.hardware import CATALOG

    rows = []
    for run in maxtext_runs():
        compute, exposed = compiler_step(run), exposed_step(run)
        if compute is None:
            continue
        published, how = published_step_seconds(run)
        peak = CATALOG[run.chip].peaks.peak_flops if CATALOG[run.chip].peaks else None
        model = model_flops_per_chip(run, causal_half=True)
        rows.append(
            {
                "name": run.name,
                "chip": run.chip,
                "chips": run.chips,
                "published": published,
                "published_from": how,
                "published_mfu": run.mfu,
                "compute": compute["optimal_seconds"],
                "compiler_flops": compute["flops"],
                "model_flops": model,
                "recompute": compute["flops"] / model,
                "compiler_rate_of_peak": compute["flops"] / compute["optimal_seconds"] / peak
                if peak
                else None,
                "measured_rate_of_peak": compute["flops"] / published / peak if peak else None,
                "exposed": exposed["seconds"] if exposed else 0.0,
                "compiled": exposed,
            }
        )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    build = sub.add_parser("compile", help="compile the TPU runs with MaxText")
    build.add_argument("--maxtext-python", required=True, help="python of MaxText's environment")
    build.add_argument("--runs", nargs="*", help="names of runs (default: every TPU run)")
    build.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args(argv)
    if args.command == "compile":
        compile_all(args.maxtext_python, args.runs, args.variants)
        return
    rows = tpu_rows()
    if not rows:
        sys.exit(f"no compiled runs under {COMPILED}: run `{sys.argv[0]} compile` first")
    fits = {name: evaluate(rows, name) for name in MODELS}
    # the model kept: the one whose worst held-out error is least
    chosen = min(fits, key=lambda name: fits[name]["worst_held_out_error"])
    out = {"rows": rows, "fits": fits, "chosen": chosen}
    path = os.path.join(HERE, "results", "calibration.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(table(rows, fits))
    print(f"kept: {chosen}; wrote {path}")


def table(rows, fits) -> str:
    lines = [
        "| run | published step | compiler's computation | exposed | compiler rate | "
        "measured rate | recompute | " + " | ".join(f"{m}: in / held out" for m in fits) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(fits),
    ]
    for r in rows:
        cells = [
            r["name"],
            f"{r['published']:.2f} s",
            f"{r['compute']:.2f} s",
            f"{r['exposed']:.2f} s",
            f"{r['compiler_rate_of_peak']:.0%}",
            f"{r['measured_rate_of_peak']:.0%}",
            f"{r['recompute']:.2f}x",
        ]
        for fit in fits.values():
            e = fit["rows"][r["name"]]
            cells.append(f"{e['error']:+.1%} / {e['held_out_error']:+.1%}")
        lines.append("| " + " | ".join(cells) + " |")
    for name, fit in fits.items():
        lines.append(
            f"{name}: scale {fit['scale']:.3f}; worst error {fit['worst_error']:.1%}, "
            f"held out {fit['worst_held_out_error']:.1%}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
