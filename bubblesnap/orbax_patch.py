"""bubblesnap's CheckpointManager behind Orbax's names, for code that builds Orbax's manager.

Frameworks build ``orbax.checkpoint.CheckpointManager`` inside their own code,
where a user cannot change an import. :func:`install` makes every name Orbax's
manager is reached by (:data:`NAMES`: ``orbax.checkpoint.CheckpointManager``,
``orbax.checkpoint.checkpoint_manager.CheckpointManager``,
``orbax.checkpoint.checkpoint_managers.CheckpointManager``) bubblesnap's manager
in this process: at once if Orbax is imported already, else the moment it is (an
import hook; JAX and Orbax are not imported before the program asks for them).
Orbax's options stay Orbax's (bubblesnap's manager takes them as they are). One
log line lists what was replaced and how to tell
(``orbax.checkpoint.CheckpointManager.__module__``).

Orbax's own modules keep Orbax's manager: a manager built by code inside Orbax
(its v1 ``Checkpointer``, its emergency and replicator managers) is Orbax's
class, and one log line per building module says so, with where; the modules
that subclass Orbax's manager when imported (:data:`SUBCLASSING`) are imported
first, so they subclass Orbax's.

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
#: Where bubblesnap's CheckpointManagerOptions read ``memory_interval_steps`` for a manager
#: built with Orbax's own options (what ``python -m bubblesnap.run
#: --memory-interval-steps`` sets).
MEMORY_INTERVAL_ENV = "BUBBLESNAP_MEMORY_INTERVAL_STEPS"
_TARGET = "orbax.checkpoint"
#: The modules whose ``CheckpointManager`` is Orbax's manager, replaced.
NAMES = ("orbax.checkpoint", "orbax.checkpoint.checkpoint_manager",
         "orbax.checkpoint.checkpoint_managers")
#: Orbax's modules that subclass its manager as they are imported.
SUBCLASSING = ("orbax.checkpoint.experimental.emergency.checkpoint_manager",)

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
    import importlib

    from orbax.checkpoint import checkpoint_manager

    from bubblesnap.clients.jax.checkpoint_manager import CheckpointManager

    original = checkpoint_manager.CheckpointManager
    if issubclass(original, CheckpointManager):
        return  # patched already
    for name in SUBCLASSING:
        try:
            importlib.import_module(name)
        except Exception:  # an optional part of Orbax, broken here: nothing of it to keep
            pass
    replacement = _dispatching(CheckpointManager, original)
    replaced = []
    for name in NAMES:
        module = importlib.import_module(name)
        if getattr(module, "CheckpointManager", None) is original:
            module.CheckpointManager = replacement
            replaced.append(f"{name}.CheckpointManager")
    log.warning("bubblesnap: %s are now bubblesnap's CheckpointManager "
                "(bubblesnap.clients.jax.CheckpointManager, daemon %s) in process %d; "
                "orbax.checkpoint.CheckpointManager.__module__ tells which one a process has; "
                "unset %s to use Orbax's", ", ".join(replaced),
                os.environ.get("BUBBLESNAP_DAEMON") or "at the default socket", os.getpid(),
                ENV)


def _dispatching(ours: type, original: type) -> type:
    """bubblesnap's manager, except when code inside Orbax builds one: that gets Orbax's
    own (logged once per building module, with where)."""
    told: set[str] = set()

    class CheckpointManager(ours):
        def __new__(cls, *args, **kwargs):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if cls is CheckpointManager and module.startswith("orbax."):
                if module not in told:
                    told.add(module)
                    log.warning("bubblesnap: %s (%s:%d) built Orbax's own CheckpointManager: "
                                "its steps do not go through bubblesnap's daemons", module,
                                caller.f_code.co_filename, caller.f_lineno)
                return original(*args, **kwargs)
            return super().__new__(cls)

    CheckpointManager.__module__ = ours.__module__
    CheckpointManager.__qualname__ = ours.__qualname__
    CheckpointManager.__doc__ = ours.__doc__
    return CheckpointManager


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
