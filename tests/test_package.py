"""The package's shape: the public API by name, no two modules importing each other, and
equations read only by the jaxpr layer (`jaxpipe._jaxpr`)."""

import ast
import pathlib
import subprocess
import sys

import pytest

import jaxpipe

PACKAGE = pathlib.Path(jaxpipe.__file__).parent


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(path: pathlib.Path, known: dict) -> set[str]:
    """The jaxpipe modules ``path`` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {name for name in out if name in known}


def test_the_public_api_is_named_at_the_top():
    assert "Pipeline" in jaxpipe.__all__ and "Placed" in jaxpipe.__all__
    assert dir(jaxpipe) == sorted([*jaxpipe.__all__, "__version__"])
    for name in jaxpipe.__all__:
        value = getattr(jaxpipe, name)
        assert not name.startswith("_"), name
        assert value is not None, name
    assert jaxpipe.Placed is jaxpipe.layout.Placed
    assert jaxpipe.Pipeline is jaxpipe.pipeline.Pipeline
    assert issubclass(jaxpipe.SplitFallbackWarning, Warning)
    assert jaxpipe.target is jaxpipe.analysis.target
    assert jaxpipe.plan is jaxpipe.planner.plan and jaxpipe.Plan is jaxpipe.planner.Plan
    with pytest.raises(AttributeError, match="public names"):
        jaxpipe.executor  # noqa: B018  (internal: jaxpipe._executor)


def test_the_internals_are_underscored():
    """Modules users do not import start with an underscore, and public modules import
    no private name into their own namespace under a public name."""
    internal = {"jaxpipe._executor", "jaxpipe._jaxpr", "jaxpipe._checks"}
    found = modules()
    for name in internal:
        assert name in found, name
    public = [n for n in found if not any(part.startswith("_") for part in n.split("."))]
    assert "jaxpipe.pipeline" in public and "jaxpipe.analysis.target" in public
    assert not any(n.startswith("jaxpipe.executor") or n == "jaxpipe.plan" for n in found)


def test_no_two_modules_import_each_other():
    found = modules()
    graph = {name: imports(path, found) - {name} for name, path in found.items()}
    mutual = sorted(
        (a, b) for a, targets in graph.items() for b in targets if a < b and a in graph[b]
    )
    assert mutual == [], f"modules importing each other: {mutual}"


def test_only_the_jaxpr_layer_reads_equations():
    """Outside `jaxpipe._jaxpr` nothing imports ``jax.extend`` or reads an equation's
    ``params`` (a loop variable over ``jaxpr.eqns``)."""
    offenders = []
    for name, path in modules().items():
        if name.startswith("jaxpipe._jaxpr"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                named = [node.module] if isinstance(node, ast.ImportFrom) else []
                named += [alias.name for alias in node.names]
                if any(n and n.startswith("jax.extend") for n in named):
                    offenders.append(f"{name}: imports jax.extend")
            if (
                isinstance(node, ast.For)
                and isinstance(node.iter, ast.Attribute | ast.Call)
                and "eqns" in ast.unparse(node.iter)
            ):
                variable = ast.unparse(node.target)
                for inner in ast.walk(node):
                    if (
                        isinstance(inner, ast.Attribute)
                        and inner.attr == "params"
                        and ast.unparse(inner.value) == variable
                    ):
                        offenders.append(f"{name}:{inner.lineno}: reads {variable}.params")
    assert offenders == []


def test_the_schedule_tools_import_no_jax():
    code = "import sys, jaxpipe, jaxpipe.schedules; jaxpipe.schedules.get('zbv', 4, 8); "
    code += "print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
