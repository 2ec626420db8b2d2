"""The docs site (mkdocs.yml, docs/): it builds with --strict (no page, link or anchor
gone stale, every API page's object found), every repository path a page or the README
names exists, the compatibility table names all of Orbax's surface, and the README stays
short and points to the docs."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"

#: Inline code naming a file or folder of this repository, e.g. `deploy/systemd/`.
REPO_PATH = re.compile(r"`((?:benchmarks|bubblesnap|clients|deploy|docs|examples|protos|service|"
                       r"tests)/[^`\s]*)`")


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_the_docs_build_with_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-5000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "jax" / "index.html").is_file()


def test_every_repository_path_the_docs_and_the_readme_name_exists():
    missing = []
    for page in [README, *_pages()]:
        for path in REPO_PATH.findall(page.read_text()):
            if any(c in path for c in "*<>{}$"):  # a pattern, not a path
                continue
            if not (ROOT / path.split("#")[0]).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert missing == []


def test_the_compatibility_table_names_every_orbax_method_option_and_args_type():
    ocp = pytest.importorskip("orbax.checkpoint")
    import dataclasses
    import inspect

    page = (DOCS / "orbax" / "compatibility.md").read_text()
    assert "<!-- compat-table: verify against the implementation -->" in page
    rows = {m.group(1) for m in re.finditer(r"^\| `([A-Za-z_]\w*)", page, re.MULTILINE)}
    methods = {name for name in dir(ocp.CheckpointManager) if not name.startswith("_")}
    options = {field.name for field in dataclasses.fields(ocp.CheckpointManagerOptions)}
    args = {name for name, value in vars(ocp.args).items()
            if inspect.isclass(value) and issubclass(value, ocp.args.CheckpointArgs)}
    assert {"StandardSave", "PyTreeRestore", "Composite"} <= args
    assert (methods | options | args) - rows == set()


def test_the_readme_is_short_and_points_to_the_docs():
    readme = README.read_text()
    assert len(readme.splitlines()) < 200
    assert "mkdocs serve" in readme
    linked = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    assert "docs/index.md" in linked
    for path in linked:
        assert (ROOT / path).is_file(), path
