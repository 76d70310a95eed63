"""The project's imports point one way: runtime < servers < deploy, with the tools beside the servers;
inside the runtime, its subpackages in the order fusion/__init__.py gives (RUNTIME_LAYERS).

Every `import` in the packages is read from the source (module level and inside functions alike, so a
lazy import cannot hide a cycle), and the graph of project modules is checked: no cycle, and no
module importing a layer it may not.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> the package it installs as (pyproject.toml's package-dir): one namespace, `fusion`
PACKAGES = {"fusion": "fusion", "services": "fusion.services", "deploy": "fusion.deploy", "tools": "fusion.tools"}

# layer -> the layers it may import (its own included)
ALLOWED = {
    "runtime": {"runtime"},
    "servers": {"runtime", "servers"},
    "deploy": {"runtime", "servers", "deploy"},
    "tools": {"runtime", "servers", "deploy", "tools"},  # the CLI starts servers and deployments
}


# The runtime's floors, lowest first: each may import only its own and those before it. "base" is the
# modules at fusion/'s top (config, errors, models, compute, own_thread).
RUNTIME_LAYERS = ("base", "forward", "experts", "fuse", "crosstok", "engine", "frontdoor")


def runtime_layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in RUNTIME_LAYERS else "base"


def layer_of(module: str) -> str:
    for package, layer in (("fusion.tools", "tools"), ("fusion.services", "servers"), ("fusion.deploy", "deploy")):
        if module == package or module.startswith(package + "."):
            return layer
    return "runtime"


def project_modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = package.split(".") + list(path.relative_to(ROOT / folder).with_suffix("").parts)
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


def test_the_runtime_floors_import_only_those_below():
    rank = {name: i for i, name in enumerate(RUNTIME_LAYERS)}
    graph = import_graph()
    runtime = [m for m in graph if layer_of(m) == "runtime"]
    assert {runtime_layer(m) for m in runtime} == set(RUNTIME_LAYERS)  # every floor holds modules
    wrong = [f"{module} ({runtime_layer(module)}) imports {imported} ({runtime_layer(imported)})"
             for module in runtime for imported in sorted(graph[module])
             if layer_of(imported) == "runtime" and rank[runtime_layer(imported)] > rank[runtime_layer(module)]]
    assert not wrong, "\n".join(wrong)


def test_the_wheel_installs_every_package_under_one_namespace():
    """pyproject.toml lists each package folder, mapped under `fusion`: nothing else at site-packages' top."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {package: folder for folder, package in PACKAGES.items()}
    folders = {".".join(PACKAGES[p.parts[0]].split(".") + list(p.parts[1:])) for p in
               (q.parent.relative_to(ROOT) for folder in PACKAGES for q in (ROOT / folder).rglob("__init__.py"))
               if "_generated" not in p.parts}  # built on first import, not shipped
    assert set(setuptools["packages"]) == folders
    assert {p.split(".")[0] for p in setuptools["packages"]} == {"fusion"}


def test_the_checks_can_fail():
    """The walker sees lazy imports, and the checks flag a cycle and an upward import."""
    graph = import_graph()
    assert "fusion.tools.router_training" in graph["fusion.tools.cli"]  # imported inside a command function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert layer_of("fusion.tools.bench") not in ALLOWED[layer_of("fusion.engine.core")]
    assert runtime_layer("fusion.engine.core") == "engine" and runtime_layer("fusion.config") == "base"
