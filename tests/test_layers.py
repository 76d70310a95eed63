"""The project's imports point one way: runtime < servers < deploy, with the tools beside the servers.

Every `import` in the packages is read from the source (module level and inside functions alike, so a
lazy import cannot hide a cycle), and the graph of project modules is checked: no cycle, and no
module importing a layer it may not.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fusion", "services", "deploy")

# layer -> the layers it may import (its own included)
ALLOWED = {
    "runtime": {"runtime"},
    "servers": {"runtime", "servers"},
    "deploy": {"runtime", "servers", "deploy"},
    "tools": {"runtime", "servers", "deploy", "tools"},  # the CLI starts servers and deployments
}


def layer_of(module: str) -> str:
    if module.startswith("fusion.tools"):
        return "tools"
    return {"fusion": "runtime", "services": "servers", "deploy": "deploy"}[module.split(".")[0]]


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if "protos" in parts and path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue  # generated code
            modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `module` imports anywhere in its source."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `a.b.c` names module `a.b` when `c` is an attribute
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {module: imports_of(module, path, known) for module, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycles():
    # A package's __init__ importing its own submodules is not a cycle between layers of code.
    graph = {m: {i for i in imps if not m.startswith(i + ".")} for m, imps in import_graph().items()}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_imports_point_downwards():
    wrong = [
        f"{module} ({layer_of(module)}) imports {imported} ({layer_of(imported)})"
        for module, imported_modules in import_graph().items()
        for imported in sorted(imported_modules)
        if layer_of(imported) not in ALLOWED[layer_of(module)]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_checks_can_fail():
    """The walker sees lazy imports, and the checks flag a cycle and an upward import."""
    graph = import_graph()
    assert "fusion.tools.router_training" in graph["fusion.tools.cli"]  # imported inside a command function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert layer_of("fusion.tools.bench") not in ALLOWED[layer_of("fusion.engine")]
