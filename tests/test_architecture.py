"""The import rules ARCHITECTURE.md states, checked on the source: who may import whom, that
no modules import each other in a circle, what the top of the package holds, and which
decisions are pure (no I/O, no clocks, no threads)."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Where each package's sources lie (pyproject.toml's package-dir).
PACKAGES = {"bubblesnap": "bubblesnap", "bubblesnap.protos": "protos",
            "bubblesnap.service": "service", "bubblesnap.clients": "clients"}

#: Modules that decide from state alone: they must not reach the outside world.
PURE = ["service/bubbles/planner.py", "service/bubbles/schedules.py", "service/peers/group_view.py",
        "service/store/retention.py", "service/durable/policy.py",
        "service/durable/orbax_layout.py", "service/durable/sidecar.py", "clients/log_groups.py",
        "service/store/regions.py", "service/restore/region_plan.py", "service/peers/discovery.py",
        "clients/replay_shares.py", "bubblesnap/shared/checkpoint_record.py", "service/checks.py"]
IMPURE = {"os", "socket", "threading", "time", "grpc", "subprocess", "shutil", "mmap",
          "random", "concurrent", "asyncio"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def _sources(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "_pb2" not in p.name)


def test_the_daemon_never_imports_the_clients():
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p)
                                                  if m.startswith("bubblesnap.clients"))
                 for p in _sources("service")}
    assert not {k: v for k, v in offenders.items() if v}


def test_the_clients_never_import_the_daemon():
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p)
                                                  if m.startswith("bubblesnap.service"))
                 for p in _sources("clients")}
    assert not {k: v for k, v in offenders.items() if v}


@pytest.mark.parametrize("side", ["service", "clients"])
def test_the_daemon_and_the_clients_share_only_the_wire_and_the_shared_package(side):
    allowed = ("bubblesnap.protos", "bubblesnap.shared", f"bubblesnap.{side}")
    offenders = {str(p.relative_to(ROOT)): sorted(
        m for m in _imports(p) if m.startswith("bubblesnap") and not m.startswith(allowed))
        for p in _sources(side)}
    assert not {k: v for k, v in offenders.items() if v}


@pytest.mark.parametrize("module", PURE)
def test_decisions_are_pure(module):
    used = {m.split(".")[0] for m in _imports(ROOT / module)}
    assert not used & IMPURE, f"{module} imports {sorted(used & IMPURE)}"


def test_no_file_holds_more_than_one_room():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in _sources("service") + _sources("clients")}
    assert not {path: n for path, n in sizes.items() if n > 400}, "split these by concept"


def test_a_starting_daemon_imports_no_client_library_nor_the_durable_tier_tools():
    import subprocess
    import sys
    code = ("import sys; from bubblesnap import cli; cli.parser('daemon').parse_args(['daemon']);"
            " print(sorted(m for m in ('bubblesnap.clients', 'bubblesnap.cli.inspect_command')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out


def _modules() -> dict[str, Path]:
    """Every module of the distribution by its dotted name (a package by its own)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if package == "bubblesnap" and parts[0] in ("protos", "service", "clients"):
                continue  # links of a docs build, not the sources
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports, at any depth of its code (an import
    inside a function still ties the two): ``from p import m`` is module ``p.m`` where
    that is one, else ``p``; and the packages above each that importing it runs first
    (their faces), but those above ``name`` itself (they ran before it)."""
    found = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + [base] * bool(base))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    faces = {package for module in found for package in _packages_above(module)
             if not name.startswith(package + ".")}
    return ((found | faces) & modules.keys()) - {name}


def _packages_above(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for module in sorted(graph):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return circles


def test_no_modules_import_each_other_in_a_circle():
    modules = _modules()
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert len(modules) > 100 and sum(map(len, graph.values())) > 300  # the walk saw the code
    assert _circles(graph) == []


def test_the_circle_finder_finds_one(tmp_path):
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
    # a package's face runs before its modules: q.b importing p.c runs p's face, which
    # imports p.a, which imports q.b (a circle no module-to-module edge shows)
    sources = {"p/__init__.py": "from p import a\n", "p/a.py": "import q.b\n", "p/c.py": "",
               "q/__init__.py": "", "q/b.py": "from p import c\n"}
    modules = {}
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
        modules[name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")] = \
            tmp_path / name
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert graph["q.b"] == {"p", "p.c"} and graph["p.a"] == {"q", "q.b"}
    assert _circles(graph) == [["p", "p.a", "q.b"]]


def test_the_top_of_the_package_is_faces_and_packages():
    top = {p.name for p in (ROOT / "bubblesnap").iterdir() if p.name != "__pycache__"}
    files = {name for name in top if not (ROOT / "bubblesnap" / name).is_dir()}
    assert files == {"__init__.py", "__main__.py"}, "a module belongs in one of the packages"
    assert all((ROOT / "bubblesnap" / name / "__init__.py").exists() for name in top - files)


def test_a_moved_module_still_imports_by_its_old_name_with_a_warning():
    import json
    import subprocess

    code = ("import importlib, json, warnings\n"
            "from bubblesnap import MOVED\n"
            "found = {}\n"
            "for old, new in MOVED.items():\n"
            "    importlib.import_module(new)  # its own imports' warnings (JAX's) said here\n"
            "    with warnings.catch_warnings(record=True) as said:\n"
            "        warnings.simplefilter('always')\n"
            "        module = importlib.import_module(old)\n"
            "    warned = [str(w.message) for w in said if w.category is DeprecationWarning]\n"
            "    found[old] = [module is importlib.import_module(new), warned]\n"
            "print(json.dumps(found))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    from bubblesnap import MOVED

    found = json.loads(out)
    assert len(found) == len(MOVED) > 10
    for old, (same, warned) in found.items():
        assert same, old
        assert warned == [f"{old} moved to {MOVED[old]}; import it from there"], old
