"""Peak memory per chip of jaxpipe's training step against MaxText's own, compiled for the
same TPU: the same model, mesh, batch and remat, with no pipeline (pure FSDP) and with a
4-stage circular pipeline against MaxText's pipeline.

MaxText's step is its own program: its ``train_compile`` (`maxtext_compile.py`, in an
environment with MaxText installed) builds and compiles it for the topology. jaxpipe's is
`examples/train_llama.py --target` on the same shapes. Both are read by
`jaxpipe.target.analyze`; the table gives each compiler's peak per chip (arguments
included) and its temporaries.

The model is Llama-2-7B's layer (width 4096, 32 heads of 128, SwiGLU 11008, vocabulary
32000) with `LAYERS` layers, 2048 tokens a row, 2 rows a chip, bfloat16 compute over
float32 weights, AdamW, every layer recomputed in the backward (MaxText's
``remat_policy=full``, jaxpipe's ``--remat nothing``) and attention in the splash kernel
(MaxText's ``attention=flash``, jaxpipe's ``--attention splash``, tiles of 512 in both),
on 8 TPU v5p chips. jaxpipe's head gradient accumulates split over fsdp
(``--split-loss-grads``, `jaxpipe.Pipeline`'s ``split_loss_grads``), as MaxText's follows
the head's FSDP sharding.

    PYTHONPATH=. python3 benchmarks/maxtext_memory.py --maxtext-python maxtext-env/bin/python
    python3 benchmarks/maxtext_memory.py --table    # the table of the saved JSON
    PYTHONPATH=. python3 benchmarks/maxtext_memory.py --jaxpipe-only  # MaxText's saved

Compiles are kept in ``--work`` and reused; ``--out`` (default
``benchmarks/results/maxtext_memory.json``) gets the table's rows. ``--jaxpipe-only``
compiles jaxpipe's side alone and keeps MaxText's figures from ``--out`` (for a Python
without MaxText).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGET, TOPOLOGY = "v5p:2x2x2", "v5p-16"  # 8 chips; MaxText counts v5p by TensorCores
LAYERS, SEQ, ROWS_PER_CHIP, CHIPS = 8, 2048, 2, 8
MAXTEXT_MODEL = [
    "model_name=llama2-7b",
    "override_model_config=true",
    f"base_num_decoder_layers={LAYERS}",
    f"max_target_length={SEQ}",
    f"per_device_batch_size={ROWS_PER_CHIP}",
    "remat_policy=full",
    "attention=flash",  # splash attention on a TPU, as the example's --attention splash
    "dataset_type=synthetic",
    "enable_checkpointing=false",
    f"compile_topology={TOPOLOGY}",
    "compile_topology_num_slices=1",
]
JAXPIPE_MODEL = [
    "--layers", str(LAYERS), "--width", "4096", "--heads", "32", "--kv-heads", "32",
    "--hidden", "11008", "--vocab", "32000", "--seq", str(SEQ),
    "--batch", str(ROWS_PER_CHIP * CHIPS), "--bf16", "--remat", "nothing", "--data", "1",
    "--tensor", "1", "--fsdp-gather", "per_block", "--attention", "splash",
    "--split-loss-grads",
]  # fmt: skip
RUNS = {  # name -> (MaxText's overrides, jaxpipe's flags)
    "pipe 1 x fsdp 8": (
        ["ici_fsdp_parallelism=8"],
        ["--stages", "1", "--fsdp", "8", "--microbatches", "1", "--schedule", "1f1b"],
    ),
    "pipe 4 x fsdp 2, circular, 8 micro-batches": (
        [
            "ici_pipeline_parallelism=4",
            "ici_fsdp_parallelism=2",
            "num_pipeline_microbatches=8",
            "num_layers_per_pipeline_stage=1",  # 2 repeats of 4 stages of one layer
        ],
        # circular's default: 2 repeats, 8 stages of one layer
        ["--stages", "4", "--fsdp", "2", "--microbatches", "8", "--schedule", "circular"],
    ),
}  # fmt: skip


def compile_maxtext(python: str, name: str, work: str) -> dict:
    path = os.path.join(work, f"maxtext-{_slug(name)}.json")
    if not os.path.exists(path):
        cmd = [python, os.path.join(HERE, "maxtext_compile.py"), "--target", TARGET]
        cmd += ["--out", path, *MAXTEXT_MODEL, *RUNS[name][0]]
        _run(cmd, work)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def compile_jaxpipe(name: str, work: str) -> dict:
    path = os.path.join(work, f"jaxpipe-{_slug(name)}.json")
    if not os.path.exists(path):
        script = os.path.join(ROOT, "examples", "train_llama.py")
        cmd = [sys.executable, script, "--target", TARGET, "--json", path]
        _run(cmd + JAXPIPE_MODEL + RUNS[name][1], work)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _run(cmd: list[str], cwd: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"failed:\n{done.stderr[-3000:]}{done.stdout[-2000:]}")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def with_new_jaxpipe(saved: dict, jaxpipe: dict) -> dict:
    """A saved row with jaxpipe's side recompiled, MaxText's kept as it was measured."""
    ours = jaxpipe["report"]
    return {
        **saved,
        "jaxpipe_run": jaxpipe["run"],
        "jaxpipe": {k: ours[k] for k in ("peak_bytes", "temp_bytes", "argument_bytes")},
        "jaxpipe_compile_seconds": ours["compile_seconds"],
    }


def row(name: str, maxtext: dict, jaxpipe: dict) -> dict:
    """One row of the table: each step's bytes per chip, as its compiler assigns them."""
    ours, theirs = jaxpipe["report"], maxtext["report"]
    return {
        "run": name,
        "maxtext_overrides": maxtext["overrides"],
        "jaxpipe_run": jaxpipe["run"],
        "maxtext": {k: theirs[k] for k in ("peak_bytes", "temp_bytes", "argument_bytes")},
        "jaxpipe": {k: ours[k] for k in ("peak_bytes", "temp_bytes", "argument_bytes")},
        "maxtext_compile_seconds": maxtext["compile_seconds"],
        "jaxpipe_compile_seconds": ours["compile_seconds"],
        "jax": {"maxtext": maxtext["jax"]},
    }


def table(rows: list[dict]) -> str:
    gib = 2**30
    lines = [
        "| mesh | MaxText peak | jaxpipe peak | jaxpipe / MaxText | MaxText temporaries | "
        "jaxpipe temporaries |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, j = r["maxtext"], r["jaxpipe"]
        lines.append(
            f"| {r['run']} | {m['peak_bytes'] / gib:.2f} GiB | {j['peak_bytes'] / gib:.2f} GiB "
            f"| {j['peak_bytes'] / m['peak_bytes']:.2f} | {m['temp_bytes'] / gib:.2f} GiB | "
            f"{j['temp_bytes'] / gib:.2f} GiB |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--maxtext-python", help="a Python with MaxText installed")
    parser.add_argument("--table", action="store_true", help="print the saved JSON's table")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "maxtext_memory.json"))
    parser.add_argument("--work", default="/tmp/maxtext_memory", help="where compiles are kept")
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument(
        "--jaxpipe-only",
        action="store_true",
        help="compile jaxpipe's side only; MaxText's figures are the saved --out's",
    )
    args = parser.parse_args(argv)
    if args.table:
        with open(args.out, encoding="utf-8") as f:
            print(table(json.load(f)["rows"]))
        return
    if args.jaxpipe_only:
        with open(args.out, encoding="utf-8") as f:
            out = json.load(f)
        os.makedirs(args.work, exist_ok=True)
        saved = {r["run"]: r for r in out["rows"]}
        missing = set(args.runs) - set(saved)
        if missing:
            parser.error(f"--jaxpipe-only: no saved MaxText figures for {sorted(missing)}")
        out["rows"] = [
            with_new_jaxpipe(r, compile_jaxpipe(r["run"], args.work))
            if r["run"] in args.runs
            else r
            for r in out["rows"]
        ]
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        print(table(out["rows"]))
        print(f"wrote {args.out}")
        return
    if not args.maxtext_python:
        parser.error("--maxtext-python is needed to compile MaxText's step (or --table)")
    os.makedirs(args.work, exist_ok=True)
    rows = []
    for name in args.runs:
        maxtext = compile_maxtext(args.maxtext_python, name, args.work)
        jaxpipe = compile_jaxpipe(name, args.work)
        rows.append(row(name, maxtext, jaxpipe))
    out = {
        "target": TARGET,
        "model": {"layers": LAYERS, "width": 4096, "heads": 32, "kv_heads": 32,
                  "hidden": 11008, "vocab": 32000, "seq": SEQ,
                  "rows_per_chip": ROWS_PER_CHIP},
        "rows": rows,
    }  # fmt: skip
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(table(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
