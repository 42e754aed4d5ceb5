"""The compiler outputs docs/compile_only.md and docs/llama3_70b.md quote are what the
compilers give: benchmarks/doc_figures.py writes them between markers, and each configuration
either lowers to the very programs the saved figures were compiled from (same digest of the
lowered program, target, XLA_FLAGS and compiler versions: the compilers are deterministic, so
compiling again gives the saved figures) or, compiled again, moves no quoted figure (memory,
collective counts and bytes, the compiler's estimates) by more than 5%.

The pages quote jax 0.10.2's compilers (libtpu 0.0.42.1, jax-cuda12-plugin 0.10.2); on
another jax the compile checks skip. Two configurations are checked where another test
compiles them already: the page's own code block (tests/test_docs.py) and Llama-3 8B 1f1b on
8 H100s (tests/test_llama_scale.py).
"""

import pathlib

import figures
import pytest
from figures import doc_figures

ROOT = pathlib.Path(__file__).resolve().parent.parent
ELSEWHERE = {"snippet-v5p", "8b-h100-1f1b"}
PAGES = sorted({c.page for c in doc_figures.CONFIGS.values()})


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in doc_figures.CONFIGS if n not in ELSEWHERE])
def test_quoted_figures_are_what_the_compiler_gives(name):
    if why := figures.compiler_missing(name):
        pytest.skip(why)
    if doc_figures.unchanged(name, doc_figures.saved()):
        return  # the saved figures are this program's: the pages quote them (test below)
    result = doc_figures.run(name)
    doc_figures.output(result)  # raises with the error if it neither compiled nor was refused
    problems = figures.drift(name, result)
    assert not problems, figures.message(problems)


@pytest.mark.slow
def test_a_digest_names_one_program():
    """Lowered twice, a configuration gives the same digest; under another schedule, another
    (so a saved digest stands for the program its figures were compiled from)."""
    if why := figures.compiler_missing("8b-h100-1f1b"):
        pytest.skip(why)
    (digest,) = doc_figures.run("8b-h100-1f1b", lower_only=True)["programs"]
    assert len(digest) == 64
    assert doc_figures.run("8b-h100-1f1b", lower_only=True)["programs"] == [digest]
    assert doc_figures.run("8b-h100-zbv", lower_only=True)["programs"] != [digest]


@pytest.mark.parametrize("page", PAGES)
def test_pages_quote_the_saved_results(page):
    """Every marked figure of the page is the script's rendering of the saved results, and
    every configuration the script compiles is quoted."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert doc_figures.rewrite(text, doc_figures.saved()) == text
    quoted = doc_figures.names(text)
    assert quoted == {n for n, c in doc_figures.CONFIGS.items() if c.page == page}


def test_drift_finds_a_moved_figure_and_leaves_compile_times_out():
    quoted = (
        "<!-- figures:a -->\n```text\ncompiled in 30.6 s\n  peak  83.14 GiB\n  x10\n```\n"
        "<!-- /figures:a -->\nneeds <!-- fig:a.peak -->83.14<!-- /fig --> GiB"
    )
    assert doc_figures.drift(quoted, quoted.replace("30.6 s", "99.0 s")) == []
    assert doc_figures.drift(quoted, quoted.replace("83.14", "80.00")) == []  # 3.8%
    moved = doc_figures.drift(quoted, quoted.replace("83.14", "71.83"))
    assert len(moved) == 2 and "71.83" in moved[0] and "71.83" in moved[1]
    assert doc_figures.drift(quoted, quoted.replace("x10", "x11"))
    assert doc_figures.drift(quoted, quoted.replace("  x10\n", "  x10\n  x1\n"))
    assert doc_figures.drift(quoted, quoted.replace("GiB\n", "MiB\n"))


def test_the_table_of_every_configuration_has_one_writer():
    """docs/llama3_70b.md's table of every configuration is doc_figures.py's to write (the
    page and doc_figures.json); benchmarks/scale.py compiles the very commands of its rows
    and writes its reports only where ``--out`` says (it kept a copy of its own,
    benchmarks/results/scale.json, that had fallen behind the page)."""
    import scale

    assert not (ROOT / "benchmarks" / "results" / "scale.json").exists()
    rows = [n for n, c in doc_figures.CONFIGS.items() if c.table and c.table[0] == "scale"]
    assert rows == scale.CONFIGS
    for name in rows:
        argv = doc_figures.CONFIGS[name].argv
        remat = argv[argv.index("--remat") + 1]
        flags = scale.command(name, remat, False, "report.json")
        assert tuple(flags[2:-2]) == argv[1:] and flags[1].endswith(argv[0])
