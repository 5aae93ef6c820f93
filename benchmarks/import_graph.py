"""The project's own import graph, read from the code (not from running it): every import of a
project module, top-level, inside functions and under `TYPE_CHECKING` alike.

`python -m benchmarks.import_graph` writes benchmarks/results/import_graph.{json,md}: for the whole
library (`swarm`, one node per top-level module or folder) and for the fabric (one node per file or
folder of `swarm/fabric`): nodes, edges among them, levels (the longest chain of imports, counted in
nodes, with each circle taken as one node), upward edges (those that close a circle: the back edges
of a depth-first walk) and circles; the share of imports of the project's own modules that sit inside
functions; the longest function. tests/test_layers.py asserts no circle from the same graph.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("swarm", "peers", "bootstrap")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the project module it names, dotted
    in_function: bool  # inside a def (imported when called, not when loaded)
    line: int


@dataclass
class Project:
    files: dict[str, Path] = field(default_factory=dict)  # module -> file
    imports: list[Import] = field(default_factory=list)
    all_import_statements: int = 0  # every import statement of the library, third-party ones too
    in_function_statements: int = 0


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(project: Project, base: str, names: list[str]) -> list[str]:
    """The project modules that `from base import names` loads: base.name where that is a module,
    base itself otherwise."""
    found = []
    for name in names:
        candidate = f"{base}.{name}"
        found.append(candidate if candidate in project.files else base)
    return found


def _walk(node: ast.AST, in_function: bool = False):
    for child in ast.iter_child_nodes(node):
        inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield child, in_function
        yield from _walk(child, inside)


def read_project(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> Project:
    project = Project()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            project.files[module_name(path)] = path
    for module, path in project.files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node, in_function in _walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if module.startswith("swarm"):
                project.all_import_statements += 1
                project.in_function_statements += in_function
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = _resolve(project, base, [a.name for a in node.names])
            for target in dict.fromkeys(targets):
                if target.split(".")[0] in packages and target in project.files and target != module:
                    project.imports.append(Import(module, target, in_function, node.lineno))
    return project


def node_of(module: str, package: str) -> str | None:
    """The direct child of `package` that `module` belongs to, or None outside it (or its own
    __init__)."""
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1:].split(".")[0]


def graph(project: Project, package: str) -> dict[str, set[str]]:
    nodes: dict[str, set[str]] = defaultdict(set)
    for module in project.files:
        if (name := node_of(module, package)) is not None:
            nodes[name]
    for imp in project.imports:
        a, b = node_of(imp.source, package), node_of(imp.target, package)
        if a is not None and b is not None and a != b:
            nodes[a].add(b)
    return dict(nodes)


def module_graph(project: Project) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in project.files}
    for imp in project.imports:
        edges[imp.source].add(imp.target)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def upward_edges(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Edges that close a circle: the back edges of a depth-first walk in sorted order."""
    state: dict[str, int] = {}  # 1 on the walk's path, 2 done
    back = []
    for start in sorted(edges):
        if start in state:
            continue
        state[start] = 1
        work = [(start, iter(sorted(edges[start])))]
        while work:
            node, children = work[-1]
            for child in children:
                if state.get(child) == 1:
                    back.append((node, child))
                elif child not in state:
                    state[child] = 1
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
            else:
                state[node] = 2
                work.pop()
    return back


def levels(edges: dict[str, set[str]]) -> int:
    """The longest chain of imports, in nodes, with each circle taken as one node."""
    component = {n: n for n in edges}
    for circle in circles(edges):
        for member in circle:
            component[member] = circle[0]
    dag: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges.items():
        dag[component[a]]
        for b in targets:
            if component[a] != component[b]:
                dag[component[a]].add(component[b])
    depth: dict[str, int] = {}

    def depth_of(node: str) -> int:
        if node not in depth:
            depth[node] = 1 + max((depth_of(b) for b in dag[node]), default=0)
        return depth[node]

    return max((depth_of(n) for n in list(dag)), default=0)


def longest_function(project: Project) -> tuple[int, str]:
    best = (0, "")
    for module, path in project.files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                best = max(best, (node.end_lineno - node.lineno + 1, f"{module}.{node.name}"))
    return best


def summary(package: str, edges: dict[str, set[str]]) -> dict:
    return {
        "package": package,
        "nodes": len(edges),
        "edges": sum(len(t) for t in edges.values()),
        "levels": levels(edges),
        "upward_edges": [f"{a} -> {b}" for a, b in upward_edges(edges)],
        "circles": circles(edges),
    }


def measure(root: Path = ROOT) -> dict:
    project = read_project(root)
    own = [i for i in project.imports if i.source.startswith("swarm")]
    length, name = longest_function(project)
    return {
        "library": summary("swarm", graph(project, "swarm")),
        "fabric": summary("swarm.fabric", graph(project, "swarm.fabric")),
        "module_circles": circles(module_graph(project)),
        "library_imports": project.all_import_statements,
        "library_imports_in_functions": project.in_function_statements,
        "own_imports": len(own),
        "own_imports_in_functions": sum(i.in_function for i in own),
        "longest_function": {"lines": length, "name": name},
    }


def markdown(figures: dict) -> str:
    rows = ["| graph | nodes | edges | levels | upward edges | circles |", "|---|---|---|---|---|---|"]
    for key in ("library", "fabric"):
        f = figures[key]
        rows.append(f"| {f['package']} | {f['nodes']} | {f['edges']} | {f['levels']} | {len(f['upward_edges'])} | {len(f['circles'])} |")
    own, inside = figures["own_imports"], figures["own_imports_in_functions"]
    rows += ["", f"- circles among modules (every import counted): {len(figures['module_circles'])}",
             f"- imports of the project's own modules inside functions (library): {inside} of {own} ({inside / max(own, 1):.0%})",
             f"- every import statement of the library inside functions: {figures['library_imports_in_functions']} of "
             f"{figures['library_imports']}",
             f"- longest function: {figures['longest_function']['name']}, {figures['longest_function']['lines']} lines"]
    for circle in figures["module_circles"]:
        rows.append(f"  - circle: {' , '.join(circle)}")
    return "\n".join(rows) + "\n"


def run() -> None:
    from benchmarks.common import write_result

    figures = measure()
    write_result("import_graph", figures, "# Import graph\n\n" + markdown(figures))


if __name__ == "__main__":
    import json

    print(json.dumps(measure(), indent=1))
