"""The import rules ARCHITECTURE.md states, checked on the source: who may import whom, and
which decisions are pure (no I/O, no clocks, no threads)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Modules that decide from state alone: they must not reach the outside world.
PURE = ["service/bubbles/planner.py", "service/bubbles/schedules.py", "service/peers/group_view.py",
        "service/store/retention.py", "service/durable/policy.py",
        "service/durable/orbax_layout.py", "service/durable/sidecar.py", "clients/log_groups.py",
        "service/store/regions.py", "service/region_plan.py", "service/peers/discovery.py",
        "clients/replay_shares.py", "bubblesnap/checkpoint_record.py"]
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
            " print(sorted(m for m in ('bubblesnap.clients', 'bubblesnap.cli_inspect')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out
