"""Calibrate jaxpipe's step-time model on published, measured training runs.

Each run of `published_runs.RUNS` that MaxText published for a TPU is compiled here, with
MaxText's own ``train_compile`` for the run's topology and settings (`maxtext_compile.py`),
three times: as published (memory and collectives: `jaxpipe.target`'s report) and with its
layers written out at one and at two layers, whose difference is the compiler's estimate
of one layer (the TPU compiler's cost analysis counts a loop's body once). The compiler's
estimate of the whole step is then ``step(1) + (layers - 1) * (step(2) - step(1))``. The
layer variants keep on the chip what a run offloads to the host (the same computation) and
take the run's limit of the chip's vector memory, which its kernel's tiles may need. A run's
attention kernel, which the estimate does not see, is counted beside it (`kernel_seconds`).

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
    # the same two layers with XLA's attention in place of the Pallas kernel: what the
    # compiler's estimate gives attention when it can see it
    "layers2-xla-attention": (
        "override_model_config=true",
        "base_num_decoder_layers=2",
        "scan_layers=false",
        "attention=dot_product",
    ),
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
    config = run.maxtext_config.split()
    if variant != "full":  # the computation alone: what the host holds kept on the chip
        config = [c.replace("=offload", "=device") for c in config]
    base = [
        f"compile_topology={topology}",
        "compile_topology_num_slices=1",
        "dataset_type=synthetic",
        "enable_checkpointing=false",
        *config,
        *VARIANTS[variant],
    ]
    path = compiled_path(run, variant)
    os.makedirs(COMPILED, exist_ok=True)
    script = os.path.join(HERE, "maxtext_compile.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    # The layer variants give the computation alone, which the collective options leave be;
    # a kernel's tiles may need the run's limit of the chip's vector memory.
    flags = run.libtpu_init_args() if variant == "full" else ""
    if variant != "full" and "DENSE_VMEM_LIMIT_FLAG" in run.xla_flags:
        flags = run.xla_flags["DENSE_VMEM_LIMIT_FLAG"]
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
def kernel_seconds(run: published_runs.PublishedRun) -> float:
    """Seconds a chip spends in the run's fused attention kernel in one step, which the
    compiler's estimate does not see (it gives the kernel's custom call a token time),
    counted as jaxpipe counts its own (`jaxpipe.analysis.kernels`): splash attention over the
    causal tiles of the run's block size (``sa_block_q``, MaxText's default 512), a layer's
    forward and its backward (in one kernel with ``sa_use_fused_bwd_kernel``), with the
    forward run again in the backward (the runs' remat policies keep matrix products of
    weights, not the kernel's output). Zero for a run without the kernel."""
    if run.attention != "flash":
        return 0.0
    from jaxpipe.analysis import kernels
    from jaxpipe.analysis.hardware import CATALOG

    m = run.model
    settings = dict(kv.split("=", 1) for kv in (run.maxtext_config or "").split())
    fused = settings.get("sa_use_fused_bwd_kernel", "false").lower() == "true"
    layer = kernels.attention_costs(
        "splash_fused" if fused else "splash",
        tile=int(settings.get("sa_block_q", 512)),
        rows=run.per_device_batch,
        seq=run.seq,
        heads=m["heads"],
        head_dim=m["head_dim"],
        peak_flops=CATALOG[run.chip].peaks.peak_flops,
        recompute_forward=True,
    )
    return m["layers"] * (layer.forward + layer.full_backward)


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


def exposed_step(run) -> dict:
    """What the report reads as exposed (not behind computation) in the published program,
    compiled here for the run's chips: once a step and in its loop (x trips), at the
    target's link bandwidths. The fit charges none of it: the runs were measured with
    options that hide their collectives (`communication_check` holds the reading against
    the room the measured step leaves)."""
    full = load(run, "full")
    if full is None:
        return {"seconds": 0.0, "why": "not compiled as published"}
    report = full["report"]
    read = (full["exposed_step_seconds"] or 0.0) + (full["loop_trips"] or 0) * (
        full["exposed_loop_seconds"] or 0.0
    )
    own_options = bool(full.get("xla_flags")) or not run.xla_flags
    return {
        "seconds": 0.0,
        "why": "hidden on the chips by the run's own options",
        "read_seconds": read,
        "read_with_the_runs_options": own_options,
        "fits": report["fits"],
        "needed_gib": report["needed_bytes"] / 2**30,
        "capacity_gib": (report["capacity_bytes"] or 0) / 2**30,
        "xla_flags": full.get("xla_flags", ""),
        "collectives": report["collectives"],
    }


def communication_check(rows, fits) -> dict:
    """Per TPU run compiled as published with its own options: the exposed time the report
    reads, against the room its measured step leaves beside the calibrated computation
    (published - scale x computation). A reading above the room is time the chips hid."""
    out = {}
    for r in rows:
        compiled = r.get("compiled") or {}
        if r["platform"] != "tpu" or not compiled.get("read_with_the_runs_options"):
            continue
        room = r["published"] - fits["tpu"]["scale"] * r["compute"]
        out[r["name"]] = {"read_seconds": compiled["read_seconds"], "room_seconds": room}
    return out


# ------------------------------------------------------------------ GPU runs: jaxpipe's proxy
# For a GPU run, the closest program jaxpipe builds (examples/train_llama.py: the same
# widths, blocks, heads, vocabulary, rows and mesh of one data-parallel replica; SwiGLU of
# the same parameter count for a GELU MLP of 4 x width), compiled for H100s by the
# example's --target --step-time --json, the JSON kept as <run>.jaxpipe.json.
GPU_PROXIES = {
    "megatron-70b-h100-768-pp2": "--target h100x16 --layers 84 --width 8192 --heads 64 "
    "--kv-heads 64 --hidden 21848 --vocab 131072 --seq 4096 --bf16 --stages 2 --tensor 8 "
    "--data 1 --batch 8 --microbatches 8 --schedule 1f1b --remat dots --sequence-parallel",
    "megatron-119b-h100-1536-pp4": "--target h100x32 --layers 92 --width 10240 --heads 80 "
    "--kv-heads 80 --hidden 27312 --vocab 131072 --seq 4096 --bf16 --stages 4 --tensor 8 "
    "--data 1 --batch 16 --microbatches 16 --schedule 1f1b --remat dots --sequence-parallel",
}


def compile_proxy(name: str) -> None:
    """Compiles `GPU_PROXIES`' program for run ``name`` with the example, here."""
    path = os.path.join(COMPILED, f"{name}.jaxpipe.json")
    example = os.path.join(os.path.dirname(HERE), "examples", "train_llama.py")
    args = [sys.executable, example, *GPU_PROXIES[name].split(), "--step-time", "--json", path]
    subprocess.run(args, check=True)


def gpu_rows() -> list[dict]:
    """Per GPU run with a compiled proxy: the published step, the raw computation jaxpipe's
    predictor gives its proxy (a roofline of XLA's counts at the GPU's peaks, through the
    table in lock-step), and no exposed communication: the runs overlap their tensor-parallel
    collectives with computation, and jaxpipe's proxy's collectives are not the run's."""
    runs = {r.name: r for r in published_runs.RUNS}
    rows = []
    for name in GPU_PROXIES:
        path = os.path.join(COMPILED, f"{name}.jaxpipe.json")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            st = json.load(f)["step_time"]
        run = runs[name]
        published, how = published_step_seconds(run)
        compute = st["ticks"] * st["tick_compute_seconds"] + st["step_compute_seconds"]
        rows.append(
            {
                "name": name,
                "platform": "cuda",
                "chip": run.chip,
                "chips": run.chips,
                "published": published,
                "published_from": how,
                "published_mfu": run.mfu,
                "compute": compute,
                "compute_from": "jaxpipe's proxy: roofline of XLA's counts, lock-step",
                "exposed": 0.0,
                "exposed_why": "taken as hidden (see gpu_rows)",
                "proxy_exposed_seconds": st["ticks"] * st["tick_exposed_seconds"]
                + st["step_exposed_seconds"],
            }
        )
    return rows


# ------------------------------------------------------------------ jaxpipe against the runs
# jaxpipe's configurations of each run's model and per-chip work (rows a chip, tokens a
# row), compiled by examples/train_llama.py --target ... --step-time --json into
# <COMPILED>/jaxpipe-<label>.json: run -> (label, mesh and choices, the example's flags).
AGAINST = {
    "maxtext-llama2-70b-v5p-512": [
        (
            "llama2-70b-v5p-64-pipe1-fsdp64-per-block",
            "pipe 1 x fsdp 64, per-block gathering, remat nothing, 4 micro-batches (64 chips)",
            "--model llama2-70b --target v5p:4x4x4 --stages 1 --fsdp 64 --tensor 1 --data 1 "
            "--batch 256 --microbatches 4 --schedule 1f1b --fsdp-gather per_block "
            "--remat nothing",
        ),
    ],
    "megatron-70b-h100-768-pp2": [
        (
            "megatron-70b-h100-16-pipe2-tensor8",
            "Megatron-LM's own mesh for one replica: pipe 2 x tensor 8, sequence-parallel, "
            "1f1b, 8 micro-batches (16 GPUs)",
            GPU_PROXIES["megatron-70b-h100-768-pp2"],
        ),
        (
            "megatron-70b-h100-32-pipe2-fsdp2-tensor8",
            "pipe 2 x fsdp 2 x tensor 8, 1f1b, 8 micro-batches (32 GPUs, 2 replicas' rows)",
            GPU_PROXIES["megatron-70b-h100-768-pp2"]
            .replace("h100x16", "h100x32")
            .replace("--data 1 --batch 8", "--fsdp 2 --data 1 --batch 16")
            .replace(" --sequence-parallel", ""),
        ),
    ],
}


def against(fits) -> list[dict]:
    """jaxpipe's compiled configurations of `AGAINST`, predicted by the calibrated model
    (the platform's scale of the computation, exposed communication as read), against the
    run's published step at the same work a chip."""
    runs = {r.name: r for r in published_runs.RUNS}
    out = []
    for name, configs in AGAINST.items():
        run = runs[name]
        published, _ = published_step_seconds(run)
        for label, what, _flags in configs:
            path = os.path.join(COMPILED, f"jaxpipe-{label}.json")
            if not os.path.exists(path):
                continue
            with open(path, encoding="utf-8") as f:
                result = json.load(f)
            st, report = result["step_time"], result["report"]
            platform = "cuda" if run.chip == "h100" else "tpu"
            scale = fits[platform]["scale"]
            compute = scale * (
                st["ticks"] * st["tick_compute_seconds"] + st["step_compute_seconds"]
            )
            exposed = st["ticks"] * st["tick_exposed_seconds"] + st["step_exposed_seconds"]
            out.append(
                {
                    "run": name,
                    "jaxpipe": what,
                    "fits": report["fits"],
                    "peak_gib": report["needed_bytes"] / 2**30,
                    "capacity_gib": report["capacity_bytes"] / 2**30,
                    "computation": compute,
                    "exposed": exposed,
                    "step": compute + exposed,
                    "published": published,
                    "throughput_ratio": published / (compute + exposed),
                    "bubble": result["run"]["bubble"],
                }
            )
    return out


# ------------------------------------------------------------------ the model and its fit
MODEL = (
    "step = scale x (the compiler's estimate of the computation, plus a fused attention "
    "kernel's matrix products at 50% of the chip's peak, which the estimate does not see) + "
    "the communication the program leaves exposed, one scale per platform (TPU: the TPU "
    "compiler's optimal_seconds; GPU: a roofline of XLA's counts at the chip's peaks)"
)


def predict(row: dict, scale: float) -> float:
    return scale * row["compute"] + row["exposed"]


def fit_scale(rows) -> float:
    """The one scale that best fits ``rows``: least squares of log(predicted / published),
    so that every run weighs the same whatever its step time."""
    import math

    lo, hi = 1e-3, 1e3  # the mean log ratio grows with the scale: bisect on it
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        mean = sum(math.log(predict(r, mid) / r["published"]) for r in rows)
        lo, hi = (mid, hi) if mean < 0 else (lo, mid)
    return math.sqrt(lo * hi)


def evaluate(rows) -> dict:
    """The scale fitted on ``rows``; each row's error in the fit and held out of it (its
    step predicted with the scale fitted on the others)."""
    scale = fit_scale(rows)
    out = {"scale": scale, "rows": {}}
    for r in rows:
        others = [o for o in rows if o is not r]
        held = fit_scale(others) if others else float("nan")
        out["rows"][r["name"]] = {
            "predicted": predict(r, scale),
            "error": predict(r, scale) / r["published"] - 1,
            "held_out_scale": held,
            "held_out_predicted": predict(r, held),
            "held_out_error": predict(r, held) / r["published"] - 1,
        }
    errors = out["rows"].values()
    out["worst_error"] = max(abs(v["error"]) for v in errors)
    out["worst_held_out_error"] = max(abs(v["held_out_error"]) for v in errors)
    return out


EXCLUDED: dict[str, str] = {}  # runs compiled but not fitted on, and why


def attention_unseen(run) -> dict | None:
    """What the compiler's estimate gives attention when it can see it: the run's two
    layers with XLA's attention against the same two layers with MaxText's Pallas kernel
    (whose FLOPs and time the cost analysis does not count), per layer; and the model's
    count of attention's FLOPs a layer (causal, at half) for comparison."""
    kernel, xla = load(run, "layers2"), load(run, "layers2-xla-attention")
    if kernel is None or xla is None:
        return None
    m = run.model
    tokens = run.per_device_batch * run.seq
    causal = 3 * tokens * 4 * run.seq * m["heads"] * m["head_dim"] / 2
    return {
        "flops_per_layer": (xla["cost"]["flops"] - kernel["cost"]["flops"]) / 2,
        "seconds_per_layer": (xla["cost"]["optimal_seconds"] - kernel["cost"]["optimal_seconds"])
        / 2,
        "model_causal_flops_per_layer": causal,
    }


def tpu_rows() -> list[dict]:
    """Per MaxText TPU run compiled here: the published step, the compiler's estimate of
    its computation, the exposed communication, and what they say about each other."""
    from jaxpipe.analysis.hardware import CATALOG

    rows = []
    for run in maxtext_runs():
        compute = compiler_step(run)
        one = load(run, "layers1")
        if compute is None and one is not None and one["cost"]["optimal_seconds"] < 0:
            EXCLUDED[run.name] = (
                f"the TPU compiler's estimate of its step at one layer is "
                f"{one['cost']['optimal_seconds']:.3g} s: not a time"
            )
            continue
        if compute is None:
            continue
        if compute["optimal_seconds_per_layer"] <= 0 or compute["optimal_seconds"] <= 0:
            EXCLUDED[run.name] = (
                f"the TPU compiler's estimate of its step is {compute['optimal_seconds']:.3g} s "
                f"({compute['optimal_seconds_per_layer']:.3g} s a layer): not a time"
            )
            continue
        exposed = exposed_step(run)
        published, how = published_step_seconds(run)
        peak = CATALOG[run.chip].peaks.peak_flops
        model = model_flops_per_chip(run, causal_half=True)
        kernel = kernel_seconds(run)
        rows.append(
            {
                "name": run.name,
                "platform": "tpu",
                "chip": run.chip,
                "chips": run.chips,
                "published": published,
                "published_from": how,
                "published_mfu": run.mfu,
                "compute": compute["optimal_seconds"] + kernel,
                "compute_from": "the TPU compiler's optimal_seconds of MaxText's own step, "
                "plus its attention kernel's time (jaxpipe.analysis.kernels)",
                "compiler_seconds": compute["optimal_seconds"],
                "kernel_seconds": kernel,
                "compiler_flops": compute["flops"],
                "model_flops": model,
                "recompute": compute["flops"] / model,
                "compiler_rate_of_peak": compute["flops"] / compute["optimal_seconds"] / peak,
                "measured_rate_of_peak": compute["flops"] / published / peak,
                "exposed": exposed["seconds"],
                "exposed_why": exposed["why"],
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
    proxies = sub.add_parser("proxies", help="compile jaxpipe's proxies of the GPU runs")
    proxies.add_argument("--runs", nargs="*", default=list(GPU_PROXIES), choices=list(GPU_PROXIES))
    args = parser.parse_args(argv)
    if args.command == "compile":
        compile_all(args.maxtext_python, args.runs, args.variants)
        return
    if args.command == "proxies":
        for name in args.runs:
            compile_proxy(name)
        return
    rows = tpu_rows() + gpu_rows()
    if not rows:
        sys.exit(f"no compiled runs under {COMPILED}: run `{sys.argv[0]} compile` first")
    fits = {}
    for platform in ("tpu", "cuda"):
        mine = [r for r in rows if r["platform"] == platform]
        if mine:
            fits[platform] = evaluate(mine)
    unseen = {r.name: attention_unseen(r) for r in maxtext_runs() if attention_unseen(r)}
    out = {"model": MODEL, "rows": rows, "fits": fits, "excluded": EXCLUDED}
    out["communication_check"] = communication_check(rows, fits)
    out["jaxpipe_against_the_runs"] = against(fits)
    out["attention_in_a_kernel"] = unseen
    path = os.path.join(HERE, "results", "calibration.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(table(rows, fits))
    for name, c in out["communication_check"].items():
        print(
            f"{name}: the report reads {c['read_seconds']:.2f} s exposed; the measured step "
            f"leaves {c['room_seconds']:.2f} s beside the calibrated computation"
        )
    for a in out["jaxpipe_against_the_runs"]:
        print(
            f"jaxpipe on {a['run']}'s work a chip, {a['jaxpipe']}: {a['step']:.2f} s "
            f"(computation {a['computation']:.2f} s + exposed {a['exposed']:.2f} s) against "
            f"{a['published']:.2f} s: {a['throughput_ratio']:.2f}x its throughput; "
            f"{'fits' if a['fits'] else 'does not fit'} ({a['peak_gib']:.2f} of "
            f"{a['capacity_gib']:.2f} GiB)"
        )
    for name, why in EXCLUDED.items():
        print(f"not fitted on {name}: {why}")
    print(f"wrote {path}")


def table(rows, fits) -> str:
    """The runs, published against predicted, as a Markdown table."""
    lines = [
        "| run | chips | published step | compiler's computation | exposed | "
        "calibrated: fitted | held out |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e = fits[r["platform"]]["rows"][r["name"]]
        lines.append(
            f"| {r['name']} | {r['chips']} {r['chip']} | {r['published']:.2f} s | "
            f"{r['compute']:.2f} s | {r['exposed']:.2f} s | {e['predicted']:.2f} s "
            f"({e['error']:+.1%}) | {e['held_out_predicted']:.2f} s ({e['held_out_error']:+.1%}) |"
        )
    for platform, fit in fits.items():
        lines.append(
            f"{platform}: scale {fit['scale']:.3f}; worst error {fit['worst_error']:.1%}, "
            f"held out {fit['worst_held_out_error']:.1%}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
