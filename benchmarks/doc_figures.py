"""The compiler outputs quoted in docs/compile_only.md and docs/llama3_70b.md, compiled again
and written into the pages.

Each configuration is one command of an example (``--target ...``, compile only) or the
python block of a page, run in a process of its own. What the pages quote of it sits between
markers the site does not show:

- ``<!-- figures:NAME -->`` ... ``<!-- /figures:NAME -->`` around a ```text block: the
  command and its output (from the line starting with ``start`` on, after ``...``; up to
  the line starting with ``stop`` included);
- ``<!-- figures:table-NAME -->`` ... ``<!-- /figures:table-NAME -->`` around a table, one
  row per configuration;
- ``<!-- fig:NAME.FIELD -->68.86<!-- /fig -->`` inline, one number of the report in GiB
  (``peak``, ``temp``, ``args``, ``headroom``), the compiler's requirement in a refusal
  (``required``, in its own G), or of a ``--step-time`` prediction (``step`` in seconds,
  ``mfu`` in %).

    python benchmarks/doc_figures.py                # compile all, rewrite the pages, write JSON
    python benchmarks/doc_figures.py --only 8b-wide-v5p gpt-h100
    python benchmarks/doc_figures.py --check        # rewrite nothing: report figures that moved
    python benchmarks/doc_figures.py --changed      # compile only what lowers differently

Results go to ``benchmarks/results/doc_figures.json``, with a digest of each program compiled
(the lowered program, the target, XLA_FLAGS and the compilers' versions): a configuration that
lowers to the same digest gives the same figures without compiling. A run keeps the
configurations it did not compile again. ``drift`` compares two versions of a page's
figures, for the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import common

# The targets compile without their chips; this process itself needs no accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

GiB = 2**30
DOCS = os.path.join(common.ROOT, "docs")
OUT = os.path.join(common.RESULTS, "doc_figures.json")
TOLERANCE = 0.05
JAX = "0.10.2"  # the jax whose compilers the pages quote

# XLA's attention, the scores materialised: what these figures were compiled with (the
# example's --attention auto picks the platform's fused kernel, as the kernel rows show)
XLA_ATTENTION = ["--attention", "xla"]
WIDE = [*XLA_ATTENTION, "--layers", "32", "--width", "4096", "--heads", "32", "--kv-heads", "8",
        "--hidden", "14336", "--seq", "2048", "--batch", "64", "--bf16"]  # fmt: skip
L8B = ["--model", "llama3-8b", *XLA_ATTENTION, "--data=2", "--stages=2", "--tensor=2",
       "--microbatches", "8", "--batch", "16"]  # fmt: skip
L70B_V5P = ["--model", "llama3-70b", *XLA_ATTENTION, "--target", "v5p:4x4x8", "--stages", "8",
            "--data", "1", "--fsdp", "4", "--tensor", "4"]  # fmt: skip
L70B_H100 = ["--model", "llama3-70b", *XLA_ATTENTION, "--target", "h100x64", "--stages", "8",
             "--data", "1", "--fsdp", "2", "--tensor", "4"]  # fmt: skip
# gathered per use, as the page says (the example's default gathers per block on GPUs)
H100_70B = [*L70B_H100, "--fsdp-gather", "per_use"]
L70B_V5P_P4 = ["--model", "llama3-70b", *XLA_ATTENTION, "--target", "v5p:4x4x8", "--stages",
               "4", "--data", "1", "--fsdp", "8", "--tensor", "4"]  # fmt: skip


def kernel(flags, name):
    """``flags`` with ``--attention name`` in place of XLA's attention."""
    i = flags.index("--attention")
    return [*flags[: i + 1], name, *flags[i + 2 :]]


M16 = ["--microbatches", "16"]
M32 = ["--microbatches", "32"]
TIME = ["--step-time"]
DOTS_ONCE = ["--remat", "dots", *TIME, "--fsdp-gather", "once"]
SP = ["--sequence-parallel"]
# The TPU compiler's collective matmuls, version 2: Megatron's gathers and reduce-scatters
# over tensor run as collective-permutes inside the matmuls that use them
TPU_CM = ["--xla-option", "xla_tpu_all_gather_collective_matmul_mode=post_spmd",
          "--xla-option", "xla_tpu_reduce_scatter_collective_matmul_mode=post_spmd"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Config:
    """One compile: ``argv`` of an example (or ``page``: run that page's python blocks)."""

    page: str
    argv: tuple = ()
    start: str | None = None  # quote the output from the first line starting with this
    stop: str | None = None  # ... up to the first line starting with this
    table: tuple = ()  # (table name, mesh text) of the row it gives

    @property
    def command(self):
        return "python3 " + " ".join(self.argv)


def llama(*flags):
    return ("examples/train_llama.py", *flags)


CONFIGS = {
    # docs/compile_only.md
    "8b-wide-v5p": Config("compile_only.md", llama("--target", "v5p:2x2x2", *WIDE)),
    "8b-wide-v5e-refused": Config(
        "compile_only.md",
        llama("--target", "v5e:4x4", "--stages", "4", "--data", "4", *WIDE),
        start="target 'v5e:4x4'",
    ),
    "8b-wide-v5e-fsdp-refused": Config(
        "compile_only.md",
        llama(
            "--target",
            "v5e:4x4",
            "--stages",
            "4",
            "--data",
            "1",
            "--fsdp",
            "4",
            "--remat",
            "nothing",
            *WIDE,
        ),
        start="target 'v5e:4x4'",
    ),
    "8b-wide-v5e-fits": Config(
        "compile_only.md",
        llama(
            "--target",
            "v5e:4x8",
            "--stages",
            "8",
            "--data",
            "1",
            "--fsdp",
            "4",
            "--remat",
            "nothing",
            "--microbatches",
            "16",
            *WIDE,
        ),
        start="target v5e:4x8:",
    ),
    "snippet-v5p": Config("compile_only.md"),
    "gpt-h100": Config("compile_only.md", ("examples/train_gpt.py", "--target", "h100x8")),
    # docs/llama3_70b.md: benchmarks/scale.py's configurations
    "8b-v5p-1f1b": Config(
        "llama3_70b.md",
        llama(*L8B[:2], "--target", "v5p:2x2x2", *L8B[2:], "--schedule", "1f1b", "--remat", "dots"),
        table=("scale", "pipe 2 x data 2 x tensor 2"),
    ),
    "8b-v5p-zbv": Config(
        "llama3_70b.md",
        llama(*L8B[:2], "--target", "v5p:2x2x2", *L8B[2:], "--schedule", "zbv", "--remat", "dots"),
        table=("scale", "pipe 2 x data 2 x tensor 2"),
    ),
    "8b-h100-1f1b": Config(
        "llama3_70b.md",
        llama(
            *L8B[:2], "--target", "h100x8", *L8B[2:], "--schedule", "1f1b", "--remat", "dots", *SP
        ),
        table=("scale", "pipe 2 x data 2 x tensor 2 (sequence-parallel)"),
    ),
    "8b-h100-zbv": Config(
        "llama3_70b.md",
        llama(
            *L8B[:2], "--target", "h100x8", *L8B[2:], "--schedule", "zbv", "--remat", "dots", *SP
        ),
        table=("scale", "pipe 2 x data 2 x tensor 2 (sequence-parallel)"),
    ),
    "70b-v5p-1f1b": Config(
        "llama3_70b.md",
        llama(*L70B_V5P, "--schedule", "1f1b", *M32, "--batch", "128", "--remat", "dots"),
        table=("scale", "pipe 8 x fsdp 4 x tensor 4"),
    ),
    "70b-v5p-zbv": Config(
        "llama3_70b.md",
        llama(*L70B_V5P, "--schedule", "zbv", *M32, "--batch", "128", "--remat", "dots"),
        table=("scale", "pipe 8 x fsdp 4 x tensor 4"),
    ),
    "70b-h100-1f1b": Config(
        "llama3_70b.md",
        llama(*H100_70B, "--schedule", "1f1b", *M32, "--batch", "64", "--remat", "dots", *SP),
        table=("scale", "pipe 8 x fsdp 2 x tensor 4 (sequence-parallel)"),
    ),
    "70b-h100-zbv": Config(
        "llama3_70b.md",
        llama(*H100_70B, "--schedule", "zbv", *M32, "--batch", "64", "--remat", "nothing", *SP),
        table=("scale", "pipe 8 x fsdp 2 x tensor 4 (sequence-parallel)"),
    ),
    # docs/llama3_70b.md: the alternatives its text weighs
    "70b-h100-zbv-whole": Config(
        "llama3_70b.md",
        llama(*H100_70B, "--schedule", "zbv", *M32, "--batch", "64", "--remat", "nothing"),
        start="target h100x64:",
        stop="  DOES NOT FIT",
    ),
    "70b-h100-zbv-dots": Config(
        "llama3_70b.md",
        llama(*H100_70B, "--schedule", "zbv", *M32, "--batch", "64", "--remat", "dots", *SP),
    ),
    "70b-h100-1f1b-whole": Config(
        "llama3_70b.md",
        llama(*H100_70B, "--schedule", "1f1b", *M32, "--batch", "64", "--remat", "nothing"),
    ),
    "70b-v5p-zbv-sp": Config(
        "llama3_70b.md",
        llama(*L70B_V5P, "--schedule", "zbv", *M32, "--batch", "128", "--remat", "dots", *SP),
    ),
    # docs/llama3_70b.md: predicted step times (--step-time), gathers per use or once, meshes
    "70b-v5p-1f1b-time": Config(
        "llama3_70b.md",
        llama(*L70B_V5P, "--schedule", "1f1b", *M32, "--batch", "128", "--remat", "dots", *TIME),
        start="predicted step time",
        table=("step-time", "pipe 8 x fsdp 4 x tensor 4"),
    ),
    "70b-v5p-1f1b-once": Config(
        "llama3_70b.md",
        llama(
            *L70B_V5P,
            "--schedule",
            "1f1b",
            *M32,
            "--batch",
            "128",
            "--remat",
            "dots",
            *TIME,
            "--fsdp-gather",
            "once",
        ),  # fmt: skip
        start="predicted step time",
        table=("step-time", "pipe 8 x fsdp 4 x tensor 4"),
    ),
    "70b-v5p-1f1b-once-cm": Config(
        "llama3_70b.md",
        llama(*L70B_V5P, "--schedule", "1f1b", *M32, "--batch", "128", *DOTS_ONCE, *TPU_CM),
        start="predicted step time",
        table=("step-time", "pipe 8 x fsdp 4 x tensor 4, collective matmuls"),
    ),
    "70b-v5p-1f1b-once-cm-splash": Config(
        "llama3_70b.md",
        llama(
            *kernel(L70B_V5P, "splash"),
            "--schedule",
            "1f1b",
            *M32,
            "--batch",
            "128",
            *DOTS_ONCE,
            *TPU_CM,
        ),  # fmt: skip
        start="predicted step time",
        table=("step-time", "pipe 8 x fsdp 4 x tensor 4, collective matmuls, splash attention"),
    ),
    "70b-v5p-1f1b-p4-once": Config(
        "llama3_70b.md",
        llama(*L70B_V5P_P4, "--schedule", "1f1b", *M16, "--batch", "128", *DOTS_ONCE),
        table=("step-time", "pipe 4 x fsdp 8 x tensor 4"),
    ),
    "70b-h100-1f1b-time": Config(
        "llama3_70b.md",
        llama(
            *H100_70B, "--schedule", "1f1b", *M32, "--batch", "64", "--remat", "dots", *SP, *TIME
        ),  # fmt: skip
        table=("step-time", "pipe 8 x fsdp 2 x tensor 4 (sequence-parallel)"),
    ),
    "70b-h100-1f1b-once": Config(
        "llama3_70b.md",
        llama(
            *L70B_H100,
            "--schedule",
            "1f1b",
            *M32,
            "--batch",
            "64",
            "--remat",
            "dots",
            *SP,
            *TIME,
            "--fsdp-gather",
            "once",
        ),  # fmt: skip
        table=("step-time", "pipe 8 x fsdp 2 x tensor 4 (sequence-parallel)"),
    ),
    "70b-h100-1f1b-once-cudnn": Config(
        "llama3_70b.md",
        llama(
            *kernel(L70B_H100, "cudnn"),
            "--schedule",
            "1f1b",
            *M32,
            "--batch",
            "64",
            "--remat",
            "dots",
            *SP,
            *TIME,
            "--fsdp-gather",
            "once",
        ),  # fmt: skip
        table=("step-time", "pipe 8 x fsdp 2 x tensor 4 (sequence-parallel), cuDNN attention"),
    ),
    "8b-h100-1f1b-whole": Config(
        "llama3_70b.md",
        llama(*L8B[:2], "--target", "h100x8", *L8B[2:], "--schedule", "1f1b", "--remat", "dots"),
    ),
}


# ----------------------------------------------------------------------------- compiling
def page_blocks(page: str) -> str:
    """The python blocks of a docs page, as test_docs runs them (one namespace, in order)."""
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        text = f.read()
    return "\n".join(re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M))


# Runs in each configuration's process before the example (or the page's code): every
# ``Target.compile`` first writes a digest of what decides the compiler's output (the lowered
# program, the target, XLA_FLAGS, the versions of jax and of the compilers, the example's
# --xla-option compiler options) to the file
# DOC_FIGURES_PROGRAMS names. With DOC_FIGURES_LOWER_ONLY set, the process ends there,
# having compiled nothing. jax is imported before the example runs: run() has set the
# XLA_FLAGS the examples would set themselves.
PROGRAM_HOOK = """
import hashlib, importlib.metadata, os, runpy, sys
import jax
from jaxpipe.analysis import target as _target

def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"

_compile = _target.Target.compile

def _compile_recorded(self, fn, *args, mesh=None, **kwargs):
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    parts = [self.name, os.environ.get("XLA_FLAGS", ""),
             *(_version(p) for p in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin")),
             jitted.lower(*args, **kwargs).as_text()]
    # compiler options given to the example (jax.jit's, not in the lowered program)
    parts += [a for i, a in enumerate(sys.argv) if i and sys.argv[i - 1] == "--xla-option"]
    with open(os.environ["DOC_FIGURES_PROGRAMS"], "a", encoding="utf-8") as f:
        f.write(hashlib.sha256("\\n".join(parts).encode()).hexdigest() + "\\n")
    if os.environ.get("DOC_FIGURES_LOWER_ONLY"):
        sys.stdout.flush()
        os._exit(0)
    return _compile(self, jitted, *args, mesh=mesh, **kwargs)

_target.Target.compile = _compile_recorded
"""
RUN_SCRIPT = """
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(name: str, lower_only: bool = False) -> dict:
    """Compile configuration ``name`` in a process of its own: its output, its report, and
    ``programs``, a digest of each program it compiled (with the target, XLA_FLAGS and the
    compilers' versions: equal digests, equal compiler output). ``lower_only``: lower the
    programs and give their digests, compile nothing (seconds instead of minutes)."""
    config = CONFIGS[name]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        env["DOC_FIGURES_PROGRAMS"] = programs = os.path.join(tmp, "programs.txt")
        if lower_only:
            env["DOC_FIGURES_LOWER_ONLY"] = "1"
        if config.argv:
            flags = list(config.argv)
            if "train_llama.py" in flags[0]:
                flags += ["--json", path]
            argv = [sys.executable, "-c", PROGRAM_HOOK + RUN_SCRIPT, *flags]
        else:
            argv = [sys.executable, "-c", PROGRAM_HOOK + page_blocks(config.page)]
        start = time.perf_counter()
        result = subprocess.run(argv, capture_output=True, text=True, cwd=common.ROOT, env=env)
        out = {"name": name, "command": config.command, "returncode": result.returncode,
               "wall_seconds": time.perf_counter() - start, "stdout": result.stdout,
               "stderr_tail": result.stderr[-3000:]}  # fmt: skip
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                out.update(json.load(f))
        out["programs"] = []
        if os.path.exists(programs):
            with open(programs, encoding="utf-8") as f:
                out["programs"] = f.read().split()
    if lower_only and (result.returncode != 0 or not out["programs"]):
        raise RuntimeError(f"{name} did not lower:\n{out['stderr_tail']}")
    return out


def unchanged(name: str, results: dict) -> bool:
    """Whether configuration ``name`` lowers to the programs its saved result was compiled
    from, for the same compilers (then compiling it again gives the saved figures)."""
    programs = results.get(name, {}).get("programs")
    return bool(programs) and run(name, lower_only=True)["programs"] == programs


def output(result: dict) -> str:
    """What the example printed: its report, or the message it exited with."""
    if result["returncode"] == 0:
        return result["stdout"]
    lines = result["stderr_tail"].splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("target '")]
    if not said:
        raise RuntimeError(f"{result['name']} failed:\n{result['stderr_tail']}")
    return "\n".join(lines[said[-1] :]) + "\n"


# ----------------------------------------------------------------------------- rendering
def block(name: str, result: dict) -> str:
    config = CONFIGS[name]
    lines = output(result).rstrip("\n").splitlines()
    if config.start:
        first = next(i for i, x in enumerate(lines) if x.startswith(config.start))
        lines = ["...", *lines[first:]]
    if config.stop:
        last = next(i for i, x in enumerate(lines) if x.startswith(config.stop))
        lines = lines[: last + 1]
    if config.argv:
        lines = [f"$ {config.command}"] + lines
    return "```text\n" + "\n".join(lines) + "\n```"


def field(result: dict, name: str) -> str:
    """One number of a report (GiB, two decimals) or of a refusal (the compiler's G)."""
    if name == "required":
        found = re.search(r"HLO temporaries \(([\d.]+)G\)", output(result))
        return found.group(1)
    if name in ("step", "mfu"):  # the predicted step time (s) and model FLOP utilisation (%)
        step_time = result["step_time"]
        step, mfu = calibrated(step_time, result["report"]["target"], scale=1.0)
        return f"{step:.1f}" if name == "step" else f"{mfu:.1%}"[:-1]
    if name in ("cstep", "cmfu"):  # the same, calibrated
        step, mfu = calibrated(result["step_time"], result["report"]["target"])
        return f"{step:.1f}" if name == "cstep" else f"{mfu:.1%}"[:-1]
    report = result["report"]
    key = {"peak": "needed_bytes", "temp": "temp_bytes", "args": "argument_bytes",
           "headroom": "headroom_bytes"}[name]  # fmt: skip
    return f"{report[key] / GiB:.2f}"


def scale_row(name: str, result: dict) -> str:
    model, target = name.split("-")[:2]
    run_, rep = result["run"], result["report"]
    gib = lambda key: f"{rep[key] / GiB:.2f}"  # noqa: E731
    share = rep["headroom_bytes"] / rep["capacity_bytes"]
    headroom = f"{rep['headroom_bytes'] / GiB:.2f} ({share:.0%})"
    cells = [model.upper(), rep["target"], CONFIGS[name].table[1], run_["schedule"],
             run_["microbatches"], f"{run_['batch']} ({run_['batch'] * run_['seq']:,})",
             run_["remat"], gib("argument_bytes"), gib("output_bytes"), gib("temp_bytes"),
             gib("needed_bytes"), gib("capacity_bytes"), headroom,
             f"{rep['compile_seconds']:.1f} s"]  # fmt: skip
    return "| " + " | ".join(str(c) for c in cells) + " |"


def calibrated(step_time: dict, target: str, scale: float | None = None) -> tuple[float, float]:
    """(step seconds, MFU) of a saved `StepTime` (``as_dict``, raw or calibrated) under the
    calibration of ``target``'s platform (`jaxpipe.calibration`): its computation scaled;
    with ``scale=1.0``, the raw estimate."""
    from jaxpipe import calibration

    if scale is None:
        scale = calibration.get("cuda" if target.startswith("h100") else "tpu").compute_scale
    st = step_time
    step = st["ticks"] * (scale * st["tick_compute_seconds"] + st["tick_exposed_seconds"])
    step += scale * st["step_compute_seconds"] + st["step_exposed_seconds"]
    return step, st["mfu"] * st["step_seconds"] / step


def step_time_row(name: str, result: dict) -> str:
    """A configuration's predicted step time (`jaxpipe.target.StepTime`), raw and
    calibrated, and its peak."""
    run_, rep, st = result["run"], result["report"], result["step_time"]
    ms = lambda seconds: f"{seconds * 1e3:.1f} ms"  # noqa: E731
    step, mfu = calibrated(st, rep["target"])
    raw_step, raw_mfu = calibrated(st, rep["target"], scale=1.0)
    per_step = st["step_compute_seconds"] + st["step_exposed_seconds"]
    cells = [rep["target"], CONFIGS[name].table[1], run_["fsdp_gather"], run_["schedule"],
             f"{run_['microbatches']} x {run_['batch'] // run_['microbatches']}",
             st["ticks"], ms(st["tick_compute_seconds"]), ms(st["tick_exposed_seconds"]),
             ms(per_step), f"{raw_step:.2f} s", f"{raw_mfu:.1%}",
             f"{step:.2f} s", f"{mfu:.1%}",
             f"{rep['needed_bytes'] / GiB:.2f} GiB"]  # fmt: skip
    return "| " + " | ".join(str(c) for c in cells) + " |"


def schedule_row(name: str, result: dict) -> str:
    run_, rep = result["run"], result["report"]
    gib = lambda key: f"{rep[key] / GiB:.2f} GiB"  # noqa: E731
    headroom = f"{rep['headroom_bytes'] / rep['capacity_bytes']:.0%}"
    cells = [run_["schedule"], f"{run_['bubble']:.1%}", gib("argument_bytes"),
             gib("temp_bytes"), gib("needed_bytes"), f"{gib('headroom_bytes')} ({headroom})",
             f"{rep['compile_seconds']:.1f} s"]  # fmt: skip
    return "| " + " | ".join(str(c) for c in cells) + " |"


# one block's costs on one device's share, with XLA's attention and with the kernel
BLOCK_ROWS = ("70b-v5p-1f1b-once-cm", "70b-v5p-1f1b-once-cm-splash")


def block_row(name: str, result: dict) -> str:
    """One block's F, B, W and F + B + W as a device runs it (`block_costs` of the example's
    JSON), and the fused kernel's part of each."""
    costs, kernel = result["block_costs"], result["block_costs"]["kernel"]
    ms = lambda seconds: f"{seconds * 1e3:.2f} ms"  # noqa: E731
    actions = ("forward", "backward_input", "backward_weight")
    total = sum(costs[a] for a in actions)
    part = "(in the estimate)"
    if kernel is not None:
        share = sum(kernel[a] for a in actions) / total
        part = " / ".join(ms(kernel[a]) for a in actions) + f" ({share:.0%} of F + B + W)"
    cells = [result["run"]["attention"], *(ms(costs[a]) for a in actions), ms(total), part]
    return "| " + " | ".join(cells) + " |"


TABLES = {
    "block-costs": lambda results: [block_row(n, results[n]) for n in BLOCK_ROWS],
    "scale": lambda results: [
        scale_row(n, results[n]) for n, c in CONFIGS.items() if c.table and c.table[0] == "scale"
    ],
    "step-time": lambda results: [
        step_time_row(n, results[n])
        for n, c in CONFIGS.items()
        if c.table and c.table[0] == "step-time"
    ],
    "70b-v5p": lambda results: [
        schedule_row(n, results[n]) for n in ("70b-v5p-1f1b", "70b-v5p-zbv")
    ],
}
REGION = re.compile(r"(<!-- figures:([\w-]+) -->\n)(.*?)(\n<!-- /figures:\2 -->)", re.S)
INLINE = re.compile(r"(<!-- fig:([\w-]+)\.(\w+) -->)(.*?)(<!-- /fig -->)")


def rewrite(text: str, results: dict) -> str:
    """``text`` with every marked figure written from ``results`` (name -> result)."""

    def region(m):
        name = m.group(2)
        if name.startswith("table-"):
            lines = m.group(3).splitlines()
            body = TABLES[name[len("table-") :]](results)
            new = "\n".join(lines[:2] + body)  # the header and its rule stay
        else:
            new = block(name, results[name])
        return m.group(1) + new + m.group(4)

    text = REGION.sub(region, text)
    return INLINE.sub(
        lambda m: m.group(1) + field(results[m.group(2)], m.group(3)) + m.group(5), text
    )


def figures(text: str) -> list[tuple[str, str]]:
    """``(name, quoted text)`` of every marked region and inline figure of a page."""
    return [(m.group(2), m.group(3)) for m in REGION.finditer(text)] + [
        (f"{m.group(2)}.{m.group(3)}", m.group(4)) for m in INLINE.finditer(text)
    ]


def names(text: str) -> set[str]:
    """The configurations a page's figures come from."""
    found = set()
    for name, _ in figures(text):
        if name.startswith("table-"):
            table = name[len("table-") :]
            found |= {n for n, c in CONFIGS.items() if c.table and c.table[0] == table}
            found |= {"70b-v5p-1f1b", "70b-v5p-zbv"} if table == "70b-v5p" else set()
        else:
            found.add(name.split(".")[0])
    return found


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")
SECONDS = re.compile(r"-?\d[\d,]*(?:\.\d+)? s\b")  # compile times: the machine's, not figures


def drift(quoted: str, compiled: str, tolerance: float = TOLERANCE) -> list[str]:
    """Where the figures of two versions of a page differ: the marked text around the
    numbers, or a number by more than ``tolerance`` (relative). Compile times are left out."""
    problems = []
    old, new = dict(figures(quoted)), dict(figures(compiled))
    for name in old:
        a, b = SECONDS.sub("_ s", old[name]), SECONDS.sub("_ s", new[name])
        for line_a, line_b in zip(a.splitlines(), b.splitlines(), strict=False):
            if NUMBER.sub("#", line_a) != NUMBER.sub("#", line_b):
                problems.append(f"{name}: quoted {line_a!r}, compiled {line_b!r}")
                continue
            for x, y in zip(NUMBER.findall(line_a), NUMBER.findall(line_b), strict=True):
                x, y = float(x.replace(",", "")), float(y.replace(",", ""))
                if abs(x - y) > tolerance * max(abs(x), abs(y)):
                    problems.append(f"{name}: quoted {line_a!r}, compiled {line_b!r}")
                    break
        if len(a.splitlines()) != len(b.splitlines()):
            problems.append(f"{name}: quoted {len(a.splitlines())} lines, compiled "
                            f"{len(b.splitlines())}")  # fmt: skip
    return problems


def page_drift(page: str, fresh: dict) -> list[str]:
    """Figures of ``page`` that the freshly compiled ``fresh`` results (name -> result) move;
    the page's other configurations are taken from the saved results."""
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        text = f.read()
    results = saved()
    results.update(fresh)
    return drift(text, rewrite(text, results))


def saved() -> dict:
    if not os.path.exists(OUT):
        return {}
    with open(OUT, encoding="utf-8") as f:
        return {r["name"]: r for r in json.load(f)["results"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--check", action="store_true", help="rewrite nothing; report drift")
    parser.add_argument("--saved", action="store_true", help="compile nothing: use the JSON")
    parser.add_argument(
        "--changed", action="store_true", help="compile only what lowers to other programs"
    )
    args = parser.parse_args()
    results = saved()
    fresh = {}
    todo = [] if args.saved else args.only
    if args.changed:
        todo = [name for name in todo if not unchanged(name, results)]
    for name in todo:
        print(f"{name}: {CONFIGS[name].command}", flush=True)
        fresh[name] = run(name)
        print(
            f"  {fresh[name]['wall_seconds']:.0f} s, exit {fresh[name]['returncode']}", flush=True
        )
    results.update(fresh)
    for page in sorted({c.page for c in CONFIGS.values()}):
        path = os.path.join(DOCS, page)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not names(text) <= set(results):
            print(f"{page}: not rewritten, no results for {sorted(names(text) - set(results))}")
            continue
        new = rewrite(text, results)
        for problem in drift(text, new):
            print(f"{page}: {problem}")
        if not args.check and new != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
            print(f"{page}: rewritten")
    if not args.check and fresh:
        meta = common.metadata()
        for package in ("libtpu", "jax-cuda12-plugin"):
            try:
                meta[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                meta[package] = None
        ordered = [results[n] for n in CONFIGS if n in results]
        common.write_json({"meta": meta, "results": ordered}, OUT)


if __name__ == "__main__":
    main()
