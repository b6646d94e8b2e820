"""The layout's rules, read from the source.

- No import cycle among the modules of auk_worker, auk_client, auk_dev, api and bench; every import counts:
  deferred ones inside functions and ``if TYPE_CHECKING:`` ones too (a cycle for the type checker is a cycle for
  the reader).
- No product file (auk_worker, auk_client, api) over 400 lines.
- The product (auk_worker, auk_client, api) never reaches the dev tooling (auk_dev) or the benchmarks (bench),
  however many imports away.
- The rooms of the service (``auk_worker/service/``): the API never reaches the worker process's code
  (``service.worker``); the records never reach the queues, delivery or the worker; the connections reach no other
  room.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("auk_worker", "auk_client", "auk_dev", "api", "bench")
PRODUCT = ("auk_worker", "auk_client", "api")
NOT_FOR_THE_PRODUCT = ("auk_dev", "bench")
MAX_LINES = 400
SERVICE = "auk_worker.service"
# room -> the rooms (or packages) it must never reach, directly or through others
NEVER_REACHES = {
    "api": (f"{SERVICE}.worker",),
    f"{SERVICE}.records": (f"{SERVICE}.queues", f"{SERVICE}.delivery", f"{SERVICE}.worker", f"{SERVICE}.ops", "api"),
    f"{SERVICE}.connect": (f"{SERVICE}.records", f"{SERVICE}.queues", f"{SERVICE}.delivery", f"{SERVICE}.worker",
                           f"{SERVICE}.ops", "api"),
    f"{SERVICE}.queues": (f"{SERVICE}.delivery", f"{SERVICE}.worker", f"{SERVICE}.ops", "api"),
    f"{SERVICE}.delivery": (f"{SERVICE}.worker", f"{SERVICE}.ops", "api"),
    f"{SERVICE}.worker": ("api", f"{SERVICE}.ops"),
}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (a package is its __init__.py)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement: at module level, inside functions and under ``if TYPE_CHECKING:``."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports: the submodule where ``from package import name`` names one, else
    the nearest module up the dotted path."""
    known = modules()

    def nearest(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            for target in filter(None, map(nearest, targets)):
                if target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def test_the_cycle_finder_finds_a_cycle_and_only_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(component) for component in found)


def reach(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` reaches through imports -> the module that imports it (to print the way)."""
    seen: dict[str, str] = {}
    stack = [start]
    while stack:
        node = stack.pop()
        for child in graph.get(node, ()):
            if child not in seen and child != start:
                seen[child] = node
                stack.append(child)
    return seen


def _way(seen: dict[str, str], start: str, target: str) -> str:
    path = [target]
    while path[-1] != start:
        path.append(seen[path[-1]])
    return " -> ".join(reversed(path))


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_product_file_over_400_lines():
    long = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = path.read_text().count("\n")
            if lines > MAX_LINES:
                long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long, f"over {MAX_LINES} lines:\n" + "\n".join(long)


def test_the_product_never_reaches_the_dev_tooling_or_the_benchmarks():
    graph = import_graph()
    offenders = []
    for module in sorted(graph):
        if module.split(".")[0] not in PRODUCT:
            continue
        seen = reach(graph, module)
        offenders += [_way(seen, module, target) for target in sorted(seen)
                      if target.split(".")[0] in NOT_FOR_THE_PRODUCT and seen[target].split(".")[0] in PRODUCT]
    assert not offenders, "\n".join(sorted(set(offenders)))


def test_the_rooms_keep_to_their_side():
    graph = import_graph()
    offenders = []
    for room, forbidden in NEVER_REACHES.items():
        for module in sorted(m for m in graph if _inside(m, room)):
            seen = reach(graph, module)
            offenders += [_way(seen, module, target) for target in sorted(seen)
                          if any(_inside(target, f) for f in forbidden)]
    assert not offenders, "\n".join(offenders[:40])


def test_the_service_lives_in_rooms():
    """No module directly under auk_worker/service/: every one belongs to a room."""
    loose = sorted(p.name for p in (ROOT / "auk_worker" / "service").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside the rooms of auk_worker/service/: {loose}"
