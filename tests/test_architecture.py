"""The package's layers, as docs/architecture.md draws them: each subpackage imports only the ones below it
(imports inside functions included), and no module imports itself back through others."""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchrl_grpo"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def layer_table(page: str) -> dict[str, set[str]]:
    """docs/architecture.md's "who may import whom" table: each subpackage -> the ones it may import (besides
    itself); a parenthesis says why, "nothing of the package" none, "all of the above" every layer above it."""
    lines = page.splitlines()
    start = lines.index("| layer | imports |") + 2  # past the header and its rule
    rows, table = [], {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    for name, allowed in rows:
        plain = re.sub(r"\([^)]*\)", "", allowed)
        if plain.strip() == "nothing of the package":
            table[name] = set()
        elif plain.strip() == "all of the above":
            table[name] = set(table)
        else:
            table[name] = {a.strip() for a in plain.split(",") if a.strip()}
    return table


MAY_IMPORT = layer_table(ARCHITECTURE.read_text())  # each subpackage -> the subpackages it may import


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


def test_the_layer_table_is_read_from_the_page():
    assert MAY_IMPORT["core"] == set() and MAY_IMPORT["config"] == {"core", "objective"}
    assert MAY_IMPORT["run"] == set(MAY_IMPORT) - {"run"} and len(MAY_IMPORT) == 12


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
