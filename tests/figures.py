"""The docs' quoted compiler outputs (benchmarks/doc_figures.py) against a fresh compile:
for the tests that compile a quoted configuration."""

import importlib.util
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import doc_figures  # noqa: E402


def compiler_missing(name: str) -> str | None:
    """Why configuration ``name`` cannot be checked here (another jax than the pages quote,
    or its compiler is not installed), or None."""
    if jax.__version__ != doc_figures.JAX:
        return f"the pages quote jax {doc_figures.JAX}'s compilers; this is jax {jax.__version__}"
    argv = " ".join(doc_figures.CONFIGS[name].argv)
    if ("v5" in argv or name == "snippet-v5p") and not importlib.util.find_spec("libtpu"):
        return "libtpu is not installed"
    if "h100" in argv:
        try:
            if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
                return "jax's CUDA plugin is not installed"
        except ModuleNotFoundError:
            return "jax's CUDA plugin is not installed"
    if "--attention cudnn" in argv:
        try:
            if importlib.util.find_spec("nvidia.cudnn") is None:
                return "cuDNN's library is not installed (pip install nvidia-cudnn-cu12)"
        except ModuleNotFoundError:
            return "cuDNN's library is not installed (pip install nvidia-cudnn-cu12)"
    return None


def drift(name: str, result: dict) -> list[str]:
    """The figures of configuration ``name``'s page that ``result`` (``doc_figures.run``'s
    form: returncode, stdout and, from ``--json``, run and report) moves by more than 5%."""
    return doc_figures.page_drift(doc_figures.CONFIGS[name].page, {name: result})


def message(problems: list[str]) -> str:
    return "\n".join(problems) + "\n(python3 benchmarks/doc_figures.py rewrites the pages)"
