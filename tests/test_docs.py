"""The docs cannot drift from the code: every ```python block of README.md and docs/*.md runs.

Each page's blocks run in order, in one namespace, in a fresh Python with 8 CPU host
devices. A block right after a ``<!-- skip-test -->`` line is left out (for hardware-specific
snippets only). Tables of numbers are checked against the simulator.
"""

import ast
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import compiles
import figures
import pytest

from jaxpipe import schedules

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SKIP_MARKER = "<!-- skip-test -->"
# Not tutorials: the benchmark report (its blocks run for minutes, on purpose) and the error
# reference, whose snippets are fragments checked by tests/test_errors.py.
NOT_TUTORIALS = {"benchmarks.md", "errors.md"}
PAGES = [ROOT / "README.md"] + sorted(p for p in DOCS.glob("*.md") if p.name not in NOT_TUTORIALS)
# Pages whose blocks compile several pipelines of a real model: about a minute on 2 cores.
TIMEOUT = 300


def python_blocks(path):
    """``(first_line, code)`` of every ```python block of ``path`` not marked skip-test."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            previous = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            if previous != SKIP_MARKER:
                blocks.append((i + 2, "\n".join(lines[i + 1 : end])))
            i = end
        i += 1
    return blocks


RUNNER = textwrap.dedent(
    """
    import json, sys
    path, blocks = sys.argv[1], json.loads(sys.stdin.read())
    namespace = {"__name__": "__main__"}
    for first_line, code in blocks:
        # Padding makes tracebacks name the page's own line numbers.
        exec(compile("\\n" * (first_line - 1) + code, path, "exec"), namespace)
    """
)


# Pages whose code compiles pipelines; the fast loop runs the README and the pages without.
SLOW_PAGES = {
    "costs.md",
    "custom_schedule.md",
    "executor.md",
    "flax_nnx.md",
    "meshes.md",
    "moe.md",
    "own_models.md",
    "pipedream.md",
    "planning.md",
    "quickstart.md",
    "transformers.md",
}


@pytest.mark.parametrize(
    "page",
    [p if p.name not in SLOW_PAGES else pytest.param(p, marks=pytest.mark.slow) for p in PAGES],
    ids=lambda p: p.name,
)
def test_page_code_blocks_run(page, tmp_path):
    import json

    blocks = python_blocks(page)
    if not blocks:
        pytest.skip(f"{page.name} has no python blocks")
    env = dict(os.environ, **compiles.LOG)  # conftest: 8 host devices, JAX_PLATFORMS=cpu
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, str(page)],
        input=json.dumps(blocks),
        cwd=tmp_path,  # pages that write files write them here
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, f"{page.name}:\n{result.stderr[-4000:]}"
    again = compiles.step_recompiles(result.stderr)
    assert not again, (
        f"{page.name}: {again} compiled again for the same shapes (arrays made outside the "
        "step were placed elsewhere than its outputs: create them under jax.set_mesh(mesh))"
    )
    if page.name == "compile_only.md" and not figures.compiler_missing("snippet-v5p"):
        # the page quotes what its code block printed (benchmarks/doc_figures.py)
        printed = {"name": "snippet-v5p", "returncode": 0, "stdout": result.stdout}
        problems = figures.drift("snippet-v5p", printed)
        assert not problems, figures.message(problems)


def test_step_recompiles_are_found():
    step_recompiles = compiles.step_recompiles
    line = "Compiling jit(train_step) with global shapes and types (f32[2],). Argument mapping: {}"
    log = "\n".join([line.format("(A,)"), line.format("(B,)")])
    assert step_recompiles(log) == ["train_step"]
    assert step_recompiles(line.format("(A,)") + "\n" + line.replace("[2]", "[3]")) == []


def test_skip_marker_is_honoured(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n<!-- skip-test -->\n```python\nraise SystemExit\n```\n"
        "```python\ny = x\n```\n"
    )
    assert python_blocks(page) == [(2, "x = 1"), (10, "y = x")]


# ------------------------------------------------------------------ numbers in tables
OPTIONS = {"interleaved_1f1b": {"virtual_stages": 2}, "circular": {"repeats": 2}}
# A row names a schedule and, optionally, options: | `1f1b(overlap=True)` | ...
ROW = re.compile(r"^\| `(\w+)(?:\(([^)]*)\))?`[^|]*\|(.*)$")
UNEQUAL = schedules.Costs(forward=1, backward_input=1.2, backward_weight=0.8)


def schedule_rows(path):
    return [ROW.match(line) for line in path.read_text().splitlines() if ROW.match(line)]


def row_options(name, text):
    options = dict(OPTIONS.get(name, {}))
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        key, value = item.split("=")
        options[key.strip()] = ast.literal_eval(value.strip())
    return options


@pytest.mark.parametrize("path", [ROOT / "README.md", DOCS / "schedules.md"], ids=lambda p: p.name)
def test_schedule_tables_match_the_simulator(path):
    """Columns: v | bubble S=4, M=8 | bubble S=4, M=32 | bubble S=4, M=32 at F:B:W =
    1:1.2:0.8 (each lock-step / ideal; the others at the default costs) | peak activations
    per device, S=4, M=8 | device 0 memory."""
    rows = schedule_rows(path)
    names = {m.group(1) for m in rows if not m.group(2)}
    assert names >= set(schedules.names())  # every default table is listed
    for match in rows:
        name, options = match.group(1), row_options(match.group(1), match.group(2))
        cells = [c.strip() for c in match.group(3).split("|")]
        small = schedules.get(name, 4, 8, **options)
        large = schedules.get(name, 4, 32, **options)
        b8, b32, b32u = (
            schedules.bubble_fraction(small),
            schedules.bubble_fraction(large),
            schedules.bubble_fraction(large, UNEQUAL),
        )
        assert cells[0] == str(small.stages_per_device), (name, cells)
        assert cells[1] == f"{b8.lockstep:.1%} / {b8.ideal:.1%}", (name, cells)
        assert cells[2] == f"{b32.lockstep:.1%} / {b32.ideal:.1%}", (name, cells)
        assert cells[3] == f"{b32u.lockstep:.1%} / {b32u.ideal:.1%}", (name, cells)
        peak = small.peak_activations()
        assert cells[4] == ", ".join(map(str, peak)), (name, cells)
        assert float(cells[5]) == peak[0] / small.stages_per_device, (name, cells)


# ------------------------------------------------------------------ README promises
INSTALL_AND_RUN = "python3 -m pip install -e . && python3 examples/train_gpt.py"
INSTALL_AND_TEST = 'python3 -m pip install -e ".[dev]" && python3 -m pytest -n 2 tests'


def test_readme_has_exactly_the_two_setup_commands():
    readme = (ROOT / "README.md").read_text()
    commands = [line.strip() for line in readme.splitlines() if "pip install" in line]
    assert commands == [INSTALL_AND_RUN, INSTALL_AND_TEST]
    ci = ROOT / ".ci" / "run"
    if ci.exists():  # .ci/run may add pip's -q (quiet) flag
        assert INSTALL_AND_TEST in ci.read_text().replace("pip install -q ", "pip install ")


def test_images_and_pages_exist():
    readme = (ROOT / "README.md").read_text()
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme):
        assert (ROOT / image).is_file(), image
    for page in PAGES[1:]:
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text()):
            assert (DOCS / image).is_file(), (page.name, image)
    nav = re.findall(r":\s*([\w/]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert "quickstart.md" in nav and "api/pipeline.md" in nav
    # benchmarks.md is written with the benchmarks; mkdocs build --strict checks it in CI.
    missing = [p for p in nav if not (DOCS / p).is_file() and p not in NOT_TUTORIALS]
    assert not missing, missing


# ------------------------------------------------------------------ one public spelling
TAUGHT = [
    ROOT / "README.md",
    *sorted(DOCS.glob("*.md")),
    *sorted(DOCS.glob("api/*.md")),
    *sorted(DOCS.glob("*.py")),
    *sorted((ROOT / "examples").glob("*.py")),
]
PRIVATE = re.compile(r"jaxpipe[./]_(?!_)\w+")  # jaxpipe._executor, jaxpipe/_jaxpr, ...
# `import jaxpipe`, then jaxpipe.Pipeline, jaxpipe.Placed, jaxpipe.schedules.get, ...; the
# module paths of Pipeline and Placed appear only as the API reference's anchors (#...).
OTHER_SPELLING = re.compile(
    r"from jaxpipe[\w.]* import|import jaxpipe\.|(?<![\w.])pipeline\.Pipeline\b"
    r"|(?<!#)jaxpipe\.pipeline\.Pipeline\b|(?<!#)jaxpipe\.layout\.Placed\b"
)


def test_docs_and_examples_teach_one_spelling_and_nothing_private():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in TAUGHT
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if PRIVATE.search(line) or OTHER_SPELLING.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_spelling_check_finds_what_it_forbids():
    for line in [
        "from jaxpipe import pipeline",
        "pipe = pipeline.Pipeline(stage_fn, loss_fn, mesh=mesh)",
        "a `jaxpipe.layout.Placed`",
        "from jaxpipe._executor.plan import make_plan",
        "(`jaxpipe._jaxpr.residuals`)",
        "import jaxpipe.checkpoint",
        "    from jaxpipe.schedules.pipedream import weight_versions",
    ]:
        assert PRIVATE.search(line) or OTHER_SPELLING.search(line), line
    for line in [
        "import jaxpipe",
        "pipe = jaxpipe.Pipeline(stage_fn, loss_fn, mesh=mesh)",
        "[jaxpipe.pipeline](pipeline.md#jaxpipe.pipeline.Pipeline)",
        "jaxpipe.__version__",
        "`tests/test_async_executor.py`",
        "Numbers from jaxpipe's simulator",
    ]:
        assert not (PRIVATE.search(line) or OTHER_SPELLING.search(line)), line
