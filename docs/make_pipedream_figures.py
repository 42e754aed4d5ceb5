"""Draws the pictures of docs/pipedream.md (``docs/img/pipedream*.png``).

    python3 docs/make_pipedream_figures.py

Every picture is `jaxpipe.viz.draw` of a table from `jaxpipe.schedules.get` with
``show_versions=True`` (each box names the weight version its action reads): lock-step
timeline, default costs (F = B = W = 1), S = 4 devices, M = 8 micro-batches; a red tick
marks a weight update (a ``U`` action).
"""

import os

import jaxpipe

HERE = os.path.dirname(os.path.abspath(__file__))
S, M = 4, 8
FIGURES = {
    "pipedream_1f1b": ("1f1b", {}),
    "pipedream": ("pipedream", {}),
    "pipedream_2bw": ("pipedream_2bw", {}),
}

if __name__ == "__main__":
    os.makedirs(os.path.join(HERE, "img"), exist_ok=True)
    for file, (name, options) in FIGURES.items():
        path = os.path.join(HERE, "img", f"{file}.png")
        jaxpipe.viz.draw(jaxpipe.schedules.get(name, S, M, **options), path, show_versions=True)
        print(path)
