"""The gateway's layout, read from its imports (module level, inside functions and under
TYPE_CHECKING alike): no import circles, and every import points down this order:

    server, main                        the process
    api.http, api.grpc                  the front doors
    gateway, config                     the parts wired together; the one config object
    request_record                      one request as the gateway observes it
    api.*                               request body -> GenerationSpecs, tokens -> text -> bytes
    admission.*                         tenants, quotas, fair queue, capacity, TTFT estimate
    routing.*                           worker pool, scorers, router, dispatcher
    errors, generation_spec, request_metrics, package docstrings    the leaves

So admission and routing never import api, request_record, gateway, config or the process.
Between the parts only these entry points are used: api reaches routing through
routing.dispatcher (the token events it streams) and admission through admission.ticket
(Ticket) and admission.tenants (Tenant); admission reads routing only through
routing.worker_pool (the cluster's state, for capacity).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "services.gateway"
GATEWAY_DIR = ROOT / "services" / "gateway"

LEAVES = {"errors", "generation_spec", "request_metrics"}
ORDER = [  # top to bottom; a module may import its own level or any level below it
    {"server", "main"},
    {"api.http", "api.grpc"},
    {"gateway", "config"},
    {"request_record"},
    "api",
    "admission",
    "routing",
    LEAVES,
]
ENTRY_POINTS = {  # (importing part, imported part): the only modules it may name there
    ("api", "routing"): {"routing.dispatcher"},
    ("api", "admission"): {"admission.ticket", "admission.tenants"},
    ("admission", "routing"): {"routing.worker_pool"},
}
DOCSTRING_ONLY = {"", "api", "admission", "routing"}  # package __init__s: no re-export shims


def _modules() -> dict[str, Path]:
    """Short name ("api.http", "routing.scorers", "" for the package itself) -> file."""
    found = {}
    for path in sorted(GATEWAY_DIR.rglob("*.py")):
        parts = path.relative_to(GATEWAY_DIR).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _short(dotted: str) -> str | None:
    if dotted == PACKAGE:
        return ""
    if dotted.startswith(PACKAGE + "."):
        return dotted[len(PACKAGE) + 1:]
    return None


def _imported(name: str, path: Path) -> set[str]:
    """Every gateway module `name` names in an import statement, wherever the statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `.` is this module's package, `..` the one above
                here = [PACKAGE] + (package.split(".") if package else [])
                base = ".".join(here[:len(here) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            candidates = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for dotted in candidates:
            short = _short(dotted)
            if short is not None and short in MODULES and short != name:
                named.add(short)
    return named


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


NAMED = {name: _imported(name, path) for name, path in MODULES.items()}


def _edges() -> dict[str, set[str]]:
    """What importing each module runs: the modules it names, and the packages above them
    that are not already above the importer (`import a.b.c` runs a/b/__init__.py first)."""
    edges = {}
    for name, targets in NAMED.items():
        mine = set(_ancestors(name)) | {""}
        edges[name] = set(targets)
        for target in targets:
            edges[name] |= {a for a in _ancestors(target) if a not in mine and a != name}
    return edges


def _level(name: str) -> int:
    for level, members in enumerate(ORDER):
        if isinstance(members, set):
            if name in members:
                return level
        elif name == members or name.startswith(members + "."):
            return level
    return len(ORDER) - 1  # the package docstring: a leaf


def _part(name: str) -> str:
    return name.split(".")[0] if name.split(".")[0] in ("api", "admission", "routing") else ""


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_layout_test_sees_the_gateway():
    # Guards the guard: if the walk found nothing, every assertion below would pass.
    assert {"gateway", "api.http", "admission.quota", "routing.scorers.base"} <= set(MODULES)
    assert "routing.dispatcher" in NAMED["api.text_stream"]
    assert "api.request_limits" in NAMED["config"]  # an import inside a function counts


def test_the_gateway_has_no_import_circles():
    assert _cycles(_edges()) == []


def test_imports_point_down_the_layers():
    upward = sorted(f"{name} -> {target}" for name, targets in _edges().items()
                    for target in targets if _level(target) < _level(name))
    assert upward == []


def test_the_parts_meet_only_at_their_entry_points():
    crossings = sorted(
        f"{name} -> {target}" for name, targets in NAMED.items() for target in targets
        if (_part(name), _part(target)) in ENTRY_POINTS
        and target not in ENTRY_POINTS[(_part(name), _part(target))])
    assert crossings == []


def test_package_inits_say_their_responsibility_and_forward_nothing():
    for name in DOCSTRING_ONLY:
        tree = ast.parse(MODULES[name].read_text())
        assert ast.get_docstring(tree), f"{name or PACKAGE}/__init__.py has no docstring"
        assert len(tree.body) == 1, f"{name or PACKAGE}/__init__.py holds more than a docstring"


def test_every_gateway_module_starts_with_a_docstring():
    missing = sorted(name for name, path in MODULES.items()
                     if not ast.get_docstring(ast.parse(path.read_text())))
    assert missing == []
