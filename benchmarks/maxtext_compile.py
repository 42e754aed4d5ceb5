"""Compile MaxText's own training step ahead of time for a TPU topology and write what the
compiler says about it, read by jaxpipe's report, as JSON.

MaxText's ``train_compile`` builds and compiles the step exactly as its trainer would (its
model, its sharding rules, its optimizer), for a topology it does not need to be run on.
This script calls it, keeps the compiled program, and writes: the compiler's cost analysis
(FLOPs, bytes, ``optimal_seconds``), its memory analysis, and `jaxpipe.target.analyze`'s
report (collectives by kind and mesh axis, which of them run behind computation, the
exposed ones per step at the target's link bandwidths).

The TPU compiler's cost analysis counts a loop's body once, so a step whose layers run in a
``scan`` is under-counted. `benchmarks/calibration.py` therefore compiles each run three
times: as published (memory, collectives), and with its layers written out
(``scan_layers=False``) at one and at two layers, which gives the cost of the step outside
the layers and of one layer exactly; the whole step's estimate is their linear extension to
the published layer count.

It runs in an environment of its own with MaxText installed (Python 3.12+, see
`benchmarks/calibration.py`'s docstring), with jaxpipe on ``PYTHONPATH``:

    PYTHONPATH=. maxtext-env/bin/python benchmarks/maxtext_compile.py --out run.json \\
        --target v5p:4x4x4 compile_topology=v5p-128 model_name=llama2-70b ...

Arguments after the options are MaxText's own ``key=value`` overrides of its ``base.yml``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def compile_maxtext(overrides: list[str]):
    """(compiled, mesh, seconds): MaxText's ``train_compile`` of ``base.yml`` with
    ``overrides``, its compiled step kept."""
    import maxtext
    from maxtext.trainers.pre_train import train_compile

    kept = {}
    jit_and_compile = train_compile.jit_and_compile

    def keep(*args, **kwargs):
        compiled = jit_and_compile(*args, **kwargs)
        kept["compiled"], kept["mesh"] = compiled, args[3]
        return compiled

    train_compile.jit_and_compile = keep
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    start = time.perf_counter()
    train_compile.main(["train_compile", base, *overrides])
    return kept["compiled"], kept["mesh"], time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="jaxpipe's name of the topology")
    parser.add_argument("--out", required=True, help="where to write the JSON")
    parser.add_argument("overrides", nargs="+", help="MaxText's key=value overrides")
    args = parser.parse_args(argv)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    compiled, mesh, seconds = compile_maxtext(args.overrides)

    import jax

    import jaxpipe

    report = jaxpipe.target.analyze(compiled, mesh, jaxpipe.target.get(args.target), seconds)
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}
    out = {
        "overrides": args.overrides,
        "target": args.target,
        "jax": jax.__version__,
        "compile_seconds": seconds,
        "cost": {k: cost[k] for k in ("flops", "bytes accessed", "optimal_seconds") if k in cost},
        "report": report.as_dict(),
        "exposed_step_seconds": report.exposed_seconds("step"),
        "exposed_loop_seconds": report.exposed_seconds("tick") if report.ticks else 0.0,
        "loop_trips": report.ticks,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"wrote {args.out}: {seconds:.0f} s to compile", file=sys.stderr)


if __name__ == "__main__":
    main()
