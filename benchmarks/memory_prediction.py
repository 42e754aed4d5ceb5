"""Predicted memory per device (`jaxpipe.memory.predict`, from shapes) against what the
TPU and GPU compilers say, for the Llama-3 8B training step of tests/llama_step.py: 32
blocks, width 4096, SwiGLU 14336, 32 heads / 8 kv heads, vocabulary 128256, sequence 8192,
bf16 compute over float32 masters and Adam, per-block remat of matmul results, 4 stages x
tensor 2, 8 micro-batches of one row.

    python3 benchmarks/memory_prediction.py                      # v5p:2x2x2 and h100x8
    python3 benchmarks/memory_prediction.py --targets h100x8 --schedules 1f1b
    python3 benchmarks/memory_prediction.py --predict-only       # no compile: seconds

Prints the prediction's table and, unless --predict-only, the compiler's argument, temp
and peak bytes with the relative error of the predicted total against the peak.
"""

import argparse
import os
import sys

import common  # the repository root on sys.path

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

from jaxpipe import target  # noqa: E402
from tests import llama_step  # noqa: E402
from tests.test_memory_prediction import MESH, loop_state_bytes, predict_step  # noqa: E402

GiB = 2**30


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=["v5p:2x2x2", "h100x8"])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zbv"])
    parser.add_argument("--predict-only", action="store_true")
    parser.add_argument(
        "--out", default=os.path.join(common.RESULTS, "memory_prediction.json"), help="JSON path"
    )
    args = parser.parse_args()
    rows, results = [], []
    for name in args.targets:
        tgt = target.get(name)
        for schedule in args.schedules:
            step = llama_step.build(tgt, MESH, schedule)
            m = predict_step(step)
            print(f"== {name}, {schedule}, mesh {MESH}")
            print(m)
            result = {"target": name, "schedule": schedule, "mesh": MESH, "predicted": m.as_dict()}
            results.append(result)
            if args.predict_only:
                continue
            compiled = step.step.lower(*step.args).compile()
            report = target.analyze(compiled, step.pipe.mesh, tgt)
            loop = loop_state_bytes(compiled.as_text())
            error = m.total / report.peak_bytes - 1
            print(
                f"compiled: arguments {report.argument_bytes / GiB:.2f} GiB, temp "
                f"{report.temp_bytes / GiB:.2f} GiB, peak {report.peak_bytes / GiB:.2f} GiB, "
                f"schedule loop state {loop / GiB:.2f} GiB; predicted total {error:+.1%}"
            )
            rows.append((name, schedule, m, report, loop))
            result.update(compiled=report.as_dict(), loop_state_bytes=loop, error=error)
    if rows:
        print()
        print(
            "| target | schedule | params | grads | optimizer | activations | buffers | "
            "working | predicted | compiled args | temp | peak | error |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, schedule, m, r, _ in rows:
            cells = [m.params, m.grads, m.optimizer, m.activations, m.buffers, m.working]
            cells += [m.total, r.argument_bytes, r.temp_bytes, r.peak_bytes]
            print(
                f"| {name} | {schedule} | "
                + " | ".join(f"{c / GiB:.2f}" for c in cells)
                + f" | {m.total / r.peak_bytes - 1:+.1%} |"
            )
    common.write_json({"meta": common.metadata(), "results": results}, args.out)


if __name__ == "__main__":
    sys.exit(main())
