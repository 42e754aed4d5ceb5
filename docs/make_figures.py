"""Draws the schedule pictures used by README.md and the docs (``docs/img/*.png``).

    python3 docs/make_figures.py

Every picture is `jaxpipe.viz.draw` of a table from `jaxpipe.schedules.get` at the default
costs (F = B = W = 1, BW = 2): the lock-step timeline (as the executor runs it), and for the
classic full-backward 1F1B also the ideal one, to show the difference.
"""

import os

import jaxpipe

HERE = os.path.dirname(os.path.abspath(__file__))
# file -> (schedule, S, M, options, mode)
FIGURES = {
    "gpipe": ("gpipe", 4, 8, {}, "lockstep"),
    "1f1b": ("1f1b", 4, 8, {}, "lockstep"),
    "1f1b_full_lockstep": ("1f1b", 4, 8, {"split_backward": False}, "lockstep"),
    "1f1b_full_ideal": ("1f1b", 4, 8, {"split_backward": False}, "ideal"),
    "1f1b_overlap": ("1f1b", 4, 8, {"overlap": True}, "lockstep"),
    "interleaved_1f1b": ("interleaved_1f1b", 4, 8, {"virtual_stages": 2}, "lockstep"),
    "interleaved_zb": ("interleaved_zb", 4, 8, {"virtual_stages": 2}, "lockstep"),
    "zb_h1": ("zb_h1", 4, 8, {}, "lockstep"),
    "zbv": ("zbv", 4, 8, {}, "lockstep"),
}

if __name__ == "__main__":
    os.makedirs(os.path.join(HERE, "img"), exist_ok=True)
    for file, (name, S, M, options, mode) in FIGURES.items():
        path = os.path.join(HERE, "img", f"{file}.png")
        jaxpipe.viz.draw(jaxpipe.schedules.get(name, S, M, **options), path, mode=mode)
        print(path)
