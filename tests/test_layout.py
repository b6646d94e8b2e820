"""The layout's rules, read from the source: no import cycle among the modules of auk_worker, auk_client,
auk_dev, api and bench (deferred imports inside functions count; ``if TYPE_CHECKING:`` imports do not, they never
run); no file of theirs over 400 lines unless its docstring says why, on a line starting "Longer than 400 lines:";
and the engine, the service and the API never reach into the dev tooling (auk_dev) but for the CLI's
``make-tiny-checkpoint``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("auk_worker", "auk_client", "auk_dev", "api", "bench")
PRODUCT = ("auk_worker", "auk_client", "api")
MAY_USE_DEV_TOOLING = {"auk_worker.cli"}  # `auk make-tiny-checkpoint`
MAX_LINES = 400
REASON = "Longer than 400 lines:"


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (a package is its __init__.py)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level or inside functions, not under ``if TYPE_CHECKING:``."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))
    return found


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


def test_long_files_say_why():
    unexplained = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            lines = text.count("\n")
            docstring = ast.get_docstring(ast.parse(text)) or ""
            if lines > MAX_LINES and not any(line.startswith(REASON) for line in docstring.splitlines()):
                unexplained.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not unexplained, f"over {MAX_LINES} lines without a '{REASON}' line in the docstring:\n" + "\n".join(
        unexplained
    )


def test_the_product_does_not_import_the_dev_tooling():
    graph = import_graph()
    offenders = sorted(f"{module} imports {target}" for module, targets in graph.items()
                       if module.split(".")[0] in PRODUCT and module not in MAY_USE_DEV_TOOLING
                       for target in targets if target.split(".")[0] == "auk_dev")  # fmt: skip
    assert not offenders, "\n".join(offenders)
