"""Draws the schedule pictures used by README.md and the docs (``docs/img/*.png``).

    python3 docs/make_figures.py

Every picture is `jaxpipe.viz.draw` of a table from `jaxpipe.schedules.get`, lock-step
timeline, unit costs (F = B = W = 1, BW = 2).
"""

import os

from jaxpipe import schedules, viz

HERE = os.path.dirname(os.path.abspath(__file__))
FIGURES = {
    "gpipe": ("gpipe", 4, 8, {}),
    "1f1b": ("1f1b", 4, 8, {}),
    "interleaved_1f1b": ("interleaved_1f1b", 4, 8, {"virtual_stages": 2}),
    "zb_h1": ("zb_h1", 4, 8, {}),
    "zbv": ("zbv", 4, 8, {}),
}

if __name__ == "__main__":
    os.makedirs(os.path.join(HERE, "img"), exist_ok=True)
    for file, (name, S, M, options) in FIGURES.items():
        path = os.path.join(HERE, "img", f"{file}.png")
        viz.draw(schedules.get(name, S, M, **options), path)
        print(path)
