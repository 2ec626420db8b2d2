"""bubblesnap's CheckpointManager behind Orbax's name, for code that builds Orbax's manager.

Frameworks build ``orbax.checkpoint.CheckpointManager`` inside their own code,
where a user cannot change an import. :func:`install` makes the public names
``orbax.checkpoint.CheckpointManager`` and
``orbax.checkpoint.checkpoint_managers.CheckpointManager`` bubblesnap's
manager in this process: at once if Orbax is imported already, else the
moment it is (an import hook; JAX and Orbax are not imported before the
program asks for them). Orbax's own modules keep their class (its emergency
managers build the original). One log line says what was patched and how
to tell (``orbax.checkpoint.CheckpointManager.__module__``).

``python -m bubblesnap.run train.py`` installs it (bubblesnap/run.py); so does
Python's start-up in any process whose environment has
``BUBBLESNAP_ORBAX=1`` and bubblesnap's bootstrap folder on ``PYTHONPATH``
(:func:`bootstrap_path`), the convention of ``ddtrace-run`` and
``opentelemetry-instrument`` for launchers that start the processes themselves.
"""

import importlib.abc
import importlib.machinery
import logging
import os
import sys

#: The switch Python's start-up reads (bootstrap/sitecustomize.py): "1" patches.
ENV = "BUBBLESNAP_ORBAX"
_TARGET = "orbax.checkpoint"
_PATCHED = ("CheckpointManager",)

log = logging.getLogger("bubblesnap.client")


def bootstrap_path() -> str:
    """The folder to put on ``PYTHONPATH`` so processes started with ``BUBBLESNAP_ORBAX=1``
    patch themselves at start-up."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


def enabled(environ=os.environ) -> bool:
    return environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def install() -> None:
    """Puts bubblesnap's manager behind Orbax's public name: now, or when Orbax is imported."""
    if _TARGET in sys.modules and hasattr(sys.modules[_TARGET], "CheckpointManager"):
        _patch()
    elif not any(isinstance(finder, _OrbaxFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OrbaxFinder())


def uninstall() -> None:
    """Takes the import hook away and the switch off, in this process and those it starts
    (the daemon: it imports Orbax for its durable tier and never the clients)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _OrbaxFinder)]
    os.environ.pop(ENV, None)


def _patch() -> None:
    try:
        _swap()
    except Exception:  # the user's import of Orbax must not fail for it
        log.exception("bubblesnap: could not put its CheckpointManager behind Orbax's; "
                      "Orbax's own is used")


def _swap() -> None:
    import orbax.checkpoint as ocp

    from bubblesnap.clients.jax.checkpoint_manager import CheckpointManager

    original = ocp.CheckpointManager
    if original is CheckpointManager:
        return
    ocp.CheckpointManager = CheckpointManager
    managers = getattr(ocp, "checkpoint_managers", None)
    if managers is not None and getattr(managers, "CheckpointManager", None) is original:
        managers.CheckpointManager = CheckpointManager
    log.warning("bubblesnap: orbax.checkpoint.CheckpointManager is now bubblesnap's "
                "(bubblesnap.clients.jax.CheckpointManager, daemon %s) in process %d; "
                "orbax.checkpoint.CheckpointManager.__module__ tells which one a process has; "
                "unset %s to use Orbax's", os.environ.get("BUBBLESNAP_DAEMON") or
                "at the default socket", os.getpid(), ENV)


class _OrbaxFinder(importlib.abc.MetaPathFinder):
    """Finds ``orbax.checkpoint`` as the other finders do, and patches it once it ran."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, finder):
        self._loader, self._finder = loader, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        _patch()
