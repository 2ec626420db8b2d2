"""MkDocs hooks for the API pages (mkdocs.yml names this file under ``hooks``).

1. The distribution maps ``bubblesnap.service``, ``bubblesnap.clients`` and
   ``bubblesnap.protos`` to the top-level folders ``service/``, ``clients/``
   and ``protos/`` (setuptools ``package-dir``), which griffe cannot follow
   from the sources. Before a build this makes ``build/docs-api/bubblesnap/``:
   a link to every entry of ``bubblesnap/`` and to those three folders, so
   griffe reads this checkout's sources (not whatever an editable install
   points at); mkdocs.yml's python handler searches ``build/docs-api`` first.
   Nothing needs to be installed for it.
2. The docstrings are Google style but name objects with Sphinx roles
   (``:class:`Session```); rendered, the role is left in front of the code
   span, so it is dropped there.
"""

import re
import shutil
from pathlib import Path

from mkdocs.plugins import event_priority

MAPPED = ("service", "clients", "protos")
ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):(?=<code>)")


@event_priority(100)  # before mkdocstrings' on_config reads the handler's paths
def on_config(config):
    root = Path(config.config_file_path).resolve().parent
    tree = root / "build" / "docs-api" / "bubblesnap"
    if tree.exists() or tree.is_symlink():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    for entry in (root / "bubblesnap").iterdir():
        if entry.name != "__pycache__":
            (tree / entry.name).symlink_to(entry)
    for folder in MAPPED:
        (tree / folder).symlink_to(root / folder, target_is_directory=True)
    return config


def on_page_content(html, page, config, files):
    return ROLE.sub("", html)
