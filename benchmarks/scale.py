"""Llama-3 8B and 70B, compiled ahead of time for TPU v5p and H100 targets.

Measurements only. The configurations are those of the table in docs/llama3_70b.md
(``benchmarks/doc_figures.py``'s ``table-scale`` rows: the published Llama-3 shapes, 8192
tokens per row, bf16 compute on float32 master weights, AdamW, rotary, grouped-query
attention, embedding and head split by vocabulary over ``tensor``). Each is ``examples/
train_llama.py --model ... --target ...`` run in a process of its own, and a table is
printed: per device argument, output, temporary and peak bytes, the chip's memory and the
headroom, compile time on this machine, and collectives by kind and mesh axis. Where the
first policy in ``--remat`` does not fit, the next is tried (the page's ``--remat`` column
is the first that fits). The page's table and ``benchmarks/results/doc_figures.json`` are
``benchmarks/doc_figures.py``'s to write; this script writes its reports (``--json``) to
``--out`` only when given one.

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
import math
import os
import subprocess
import sys
import tempfile
import time

import common
import doc_figures

GiB = 2**30
CONFIGS = [n for n, c in doc_figures.CONFIGS.items() if c.table and c.table[0] == "scale"]
MESH_FLAGS = {"--stages": 4, "--data": 2, "--fsdp": 1, "--tensor": 1}  # the example's defaults
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
    parser.add_argument("--out", help="a JSON file for the reports (none by default)")
    return parser.parse_args()


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``name`` in ``argv`` (``--name value`` or ``--name=value``), or None."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def command(name, remat, small, json_path):
    """The example's command line of configuration ``name`` (docs/llama3_70b.md's), with
    ``--remat remat``; with ``small``, tiny shapes on as many host devices (float32)."""
    argv = list(doc_figures.CONFIGS[name].argv)
    argv[argv.index("--remat") + 1] = remat
    flags = [sys.executable, os.path.join(common.ROOT, argv[0]), *argv[1:], "--json", json_path]
    if small:  # the same mesh of host devices, float32 (the CPU compiler's bf16 is not tested)
        sizes = [_flag(argv, flag) or default for flag, default in MESH_FLAGS.items()]
        devices = math.prod(int(size) for size in sizes)
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
    if args.out and os.path.exists(args.out) and not args.small:  # keep those not rerun
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
    if args.out:
        common.write_json({"meta": meta, "results": ordered}, args.out)


if __name__ == "__main__":
    main()
