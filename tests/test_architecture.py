"""The package's layers, as docs/architecture.md draws them: each subpackage imports only the ones below it
(imports inside functions included), and no module imports itself back through others."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchrl_grpo"
# each subpackage -> the subpackages it may import (besides itself)
MAY_IMPORT = {
    "core": set(),
    "objective": {"core"},
    "config": {"core", "objective"},
    "telemetry": {"core", "config"},
    "tasks": {"core"},
    "parallel": {"core", "objective", "config"},
    "models": {"core", "config", "parallel"},
    "episodes": {"core", "tasks"},
    "engines": {"core", "config", "objective", "parallel", "models"},
    "training": {"core", "config", "objective", "parallel", "models", "engines"},
    "collect": {"core", "config", "objective", "models", "tasks", "episodes", "engines"},
    "run": {"core", "config", "objective", "telemetry", "parallel", "models", "tasks", "episodes", "engines",
            "training", "collect"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every torchrl_grpo module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("torchrl_grpo.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchrl_grpo"):
            # `from torchrl_grpo.core import errors` imports the module torchrl_grpo.core.errors
            found |= {f"{node.module}.{a.name}"
                      if (PACKAGE.parent / node.module.replace(".", "/") / f"{a.name}.py").exists()
                      else node.module for a in node.names}
    return found


MODULES = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str | None:
    """The subpackage ``module`` is in; None for the package's own face (``__init__``, ``__main__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def test_every_subpackage_has_a_layer_and_says_what_it_holds():
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(MAY_IMPORT)
    assert not [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]  # all in a layer
    for name in subpackages:
        assert ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())), name


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m)))  # the package's face may import any
def test_imports_run_down_the_layers(module):
    own = layer(module)
    upward = sorted(m for m in MODULES[module] if layer(m) not in (own, None) and layer(m) not in MAY_IMPORT[own])
    assert not upward, f"{module} imports {upward}: not below {own}"


def test_no_import_cycle():
    graph = {m: {i for i in deps if i in MODULES and i != m} for m, deps in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
