"""Llama-3 8B and 70B, compiled ahead of time for TPU v5p and H100 targets.

Measurements only. Each configuration is ``examples/train_llama.py --model ... --target ...``
(the published Llama-3 shapes, 8192 tokens per row, bf16 compute on float32 master weights,
AdamW, rotary, grouped-query attention, embedding and head split by vocabulary over
``tensor``) run in a process of its own; its report (``--json``) goes into one JSON file,
and a table is printed: per device argument, output, temporary and peak bytes, the chip's
memory and the headroom, compile time on this machine, and collectives by kind and mesh
axis. Where ``--remat dots`` does not fit, the next policy in ``--remat`` is tried.

    python benchmarks/scale.py                                  # every configuration
    python benchmarks/scale.py --only 8b-v5p-1f1b 70b-h100-zbv   # some of them
    python benchmarks/scale.py --small             # tiny shapes on host devices, float32

Compiling for a target costs what compiling on the chips would: minutes per configuration
on 2 cores (70B on 128 chips: several GB of host memory).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time

import common

GiB = 2**30
EXAMPLE = os.path.join(common.ROOT, "examples", "train_llama.py")

# name -> (model, target, mesh flags, micro-batches, global batch in rows, other flags)
# M = 4S micro-batches (1f1b's lock-step bubble 8-13%, zbv's 2-4%); one 8192-token row per
# micro-batch and batch shard (rows = M x data x fsdp) keeps activations small. On H100s
# the residual stream is split by sequence over tensor (--sequence-parallel): the CUDA
# compiler otherwise keeps and sends it whole on every tensor device; the TPU compiler
# holds less without it.
SP = ("--sequence-parallel",)
MESHES = {
    "8b-v5p": ("llama3-8b", "v5p:2x2x2", dict(stages=2, data=2, tensor=2), 8, 16, ()),
    "8b-h100": ("llama3-8b", "h100x8", dict(stages=2, data=2, tensor=2), 8, 16, SP),
    "70b-v5p": ("llama3-70b", "v5p:4x4x8", dict(stages=8, fsdp=4, tensor=4), 32, 128, ()),
    "70b-h100": ("llama3-70b", "h100x64", dict(stages=8, fsdp=2, tensor=4), 32, 64, SP),
}
SCHEDULES = ("1f1b", "zbv")
CONFIGS = [f"{mesh}-{schedule}" for mesh in MESHES for schedule in SCHEDULES]
SMALL = ["--layers", "8", "--width", "64", "--hidden", "128", "--heads", "4", "--kv-heads",
         "2", "--vocab", "256", "--seq", "32"]  # fmt: skip


def parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--remat", nargs="+", default=["dots", "nothing"],
                        help="remat policies to try in order, until one fits")  # fmt: skip
    parser.add_argument(
        "--small", action="store_true", help="tiny shapes on host devices (float32)"
    )
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "scale.json"))
    return parser.parse_args()


def command(name, remat, small, json_path):
    mesh, schedule = name.rsplit("-", 1)
    model, target, axes, microbatches, batch, other = MESHES[mesh]
    flags = [sys.executable, EXAMPLE, "--model", model, "--target", target]
    axes = {"data": 1, **axes}  # the example's default is data 2
    flags += [f"--{axis}={size}" for axis, size in axes.items()]
    flags += ["--schedule", schedule, "--microbatches", str(microbatches)]
    flags += ["--batch", str(batch), "--remat", remat, *other, "--json", json_path]
    if small:  # the same mesh of host devices, float32 (the CPU compiler's bf16 is not tested)
        devices = 1
        for size in axes.values():
            devices *= size
        flags[flags.index("--target") + 1] = f"cpu:{devices}"
        flags += [*SMALL, "--devices", str(devices), "--no-bf16"]
    return flags


def run(name, remat, small):
    with tempfile.TemporaryDirectory() as tmp:
        json_path = os.path.join(tmp, "report.json")
        flags = command(name, remat, small, json_path)
        shown = " ".join(["python3", os.path.relpath(flags[1], common.ROOT), *flags[2:]])
        shown = shown.replace(f" --json {json_path}", "")
        print(f"$ {shown}", flush=True)
        start = time.perf_counter()
        result = subprocess.run(flags, capture_output=True, text=True, cwd=common.ROOT)
        seconds = time.perf_counter() - start
        out = {"name": name, "command": shown, "returncode": result.returncode,
               "wall_seconds": seconds, "stdout": result.stdout}  # fmt: skip
        if os.path.exists(json_path):
            with open(json_path, encoding="utf-8") as f:
                out.update(json.load(f))
        else:  # refused by the compiler (does not fit) or failed: keep its last words
            lines = (result.stdout + result.stderr).strip().splitlines()
            said = [line for line in lines if "NOT FIT" in line or "Error" in line]
            out["error"] = said[-2:] or lines[-3:]
        print(result.stdout.split("target ", 2)[-1] if "report" in out else out["error"])
        return out


def main():
    args = parse()
    results = {}
    if os.path.exists(args.out) and not args.small:  # keep configurations not rerun
        with open(args.out, encoding="utf-8") as f:
            results = {r["name"]: r for r in json.load(f).get("results", [])}
    for name in args.only:
        tried = []
        for remat in args.remat:
            out = run(name, remat, args.small)
            tried.append({"remat": remat, "fits": out.get("report", {}).get("fits"),
                          "error": out.get("error")})  # fmt: skip
            if out.get("report", {}).get("fits") in (True, None):
                break
        out["tried"] = tried
        results[name] = out
    rows = []
    for name in CONFIGS:
        if name not in results:
            continue
        r = results[name]
        rep, run_ = r.get("report"), r.get("run")
        if rep is None:
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "refused"])
            continue
        gib = {k: rep[k] / GiB for k in ("argument_bytes", "output_bytes", "temp_bytes")}
        mesh = " x ".join(f"{a} {n}" for a, n in rep["mesh"].items() if n > 1)
        rows.append([name, mesh, run_["microbatches"], run_["batch"], run_["remat"],
                     round(gib["argument_bytes"], 2), round(gib["output_bytes"], 2),
                     round(gib["temp_bytes"], 2), round(rep["needed_bytes"] / GiB, 2),
                     round(rep["capacity_bytes"] / GiB, 2) if rep["capacity_bytes"] else "-",
                     f"{rep['headroom_bytes'] / rep['capacity_bytes']:.0%}"
                     if rep["capacity_bytes"] else "-",
                     round(rep["compile_seconds"], 1)])  # fmt: skip
    common.print_table(
        ["config", "mesh", "M", "batch", "remat", "args GiB", "out GiB", "temp GiB",
         "peak GiB", "capacity", "headroom", "compile s"],
        rows, title="Llama-3 compiled ahead of time, per device",
    )  # fmt: skip
    for name in CONFIGS:
        rep = results.get(name, {}).get("report")
        if rep:
            print(f"\n{name} collectives (bytes per device per execution):")
            for c in rep["collectives"]:
                where = "in loop" if c["in_loop"] else "per step"
                axes = ",".join(c["axes"]) or "-"
                print(f"  {c['kind']:<19} over {axes:<12} {where:<8} x{c['count']:<4} "
                      f"{c['bytes'] / 2**20:10.1f} MiB")  # fmt: skip
    ordered = [results[n] for n in CONFIGS if n in results]
    meta = common.metadata()
    for package in ("libtpu", "jax-cuda12-plugin"):  # the compilers
        try:
            meta[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            meta[package] = None
    common.write_json({"meta": meta, "results": ordered}, args.out)


if __name__ == "__main__":
    main()
