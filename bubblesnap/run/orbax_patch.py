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

Orbax v1's ``training.Checkpointer`` (:data:`V1_NAMES`) becomes bubblesnap's
(bubblesnap.clients.jax.training) the same way, when its module is imported, and
Orbax's emergency ``CheckpointManager`` (:data:`EMERGENCY`) bubblesnap's
(bubblesnap.clients.jax.emergency); one log line says each. A manager built by code
inside Orbax (its replicator manager's) is Orbax's class, and one log line per
building module says so, with where; the modules that subclass Orbax's manager when
imported (:data:`SUBCLASSING`) are imported first, so they subclass Orbax's.

``python -m bubblesnap.run train.py`` installs it (bubblesnap/run/launcher.py); so does
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

# (MEMORY_INTERVAL_ENV: read by the clients; named here before launch_env.py held it)
from bubblesnap.shared.launch_env import MEMORY_INTERVAL_ENV  # noqa: F401
from bubblesnap.shared.launch_env import ORBAX_SWITCH_ENV as ENV

_TARGET = "orbax.checkpoint"
#: The modules whose ``CheckpointManager`` is Orbax's manager, replaced.
NAMES = ("orbax.checkpoint", "orbax.checkpoint.checkpoint_manager",
         "orbax.checkpoint.checkpoint_managers")
#: Orbax's emergency manager's module: its ``CheckpointManager`` is replaced too.
EMERGENCY = "orbax.checkpoint.experimental.emergency.checkpoint_manager"
#: Orbax's modules that subclass its manager as they are imported.
SUBCLASSING = (EMERGENCY,)
#: The modules whose ``Checkpointer`` is Orbax v1's training Checkpointer, replaced.
V1_NAMES = ("orbax.checkpoint.experimental.v1.training", "orbax.checkpoint.v1.training")

log = logging.getLogger("bubblesnap.client")


def bootstrap_path() -> str:
    """The folder to put on ``PYTHONPATH`` so processes started with ``BUBBLESNAP_ORBAX=1``
    patch themselves at start-up."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


def enabled(environ=os.environ) -> bool:
    return environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def install() -> None:
    """Puts bubblesnap's manager behind Orbax's public names, and its v1 Checkpointer
    behind Orbax v1's: now for what is imported, the rest when it is."""
    if _TARGET in sys.modules and hasattr(sys.modules[_TARGET], "CheckpointManager"):
        _patch()
    for name in V1_NAMES:
        if hasattr(sys.modules.get(name), "Checkpointer"):
            _patch_v1(name)
    if not any(isinstance(finder, _OrbaxFinder) for finder in sys.meta_path):
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


def _patch_v1(name: str) -> None:
    try:
        from bubblesnap.clients.jax import training

        module = sys.modules[name]
        if module.Checkpointer is not training.Checkpointer and \
                module.Checkpointer is training.Checkpointer.__mro__[1]:
            module.Checkpointer = training.Checkpointer
            log.warning("bubblesnap: %s.Checkpointer is now bubblesnap's "
                        "(bubblesnap.clients.jax.training.Checkpointer) in process %d; unset "
                        "%s to use Orbax's", name, os.getpid(), ENV)
    except Exception:  # the user's import of Orbax must not fail for it
        log.exception("bubblesnap: could not put its Checkpointer behind %s's; Orbax's own "
                      "is used", name)


def _swap() -> None:
    import importlib

    from orbax.checkpoint import checkpoint_manager

    from bubblesnap.clients.jax.manager.checkpoint_manager import CheckpointManager

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
    _swap_emergency()


def _swap_emergency() -> None:
    """Orbax's emergency manager becomes bubblesnap's (bubblesnap.clients.jax.emergency:
    its local tier the daemons' memory), said once."""
    module = sys.modules.get(EMERGENCY)
    if module is None:
        return  # not importable here (SUBCLASSING imported it where it is)
    from bubblesnap.clients.jax import emergency

    if module.CheckpointManager is emergency.CheckpointManager.__mro__[1]:
        module.CheckpointManager = emergency.CheckpointManager
        log.warning("bubblesnap: %s.CheckpointManager is now bubblesnap's "
                    "(bubblesnap.clients.jax.emergency: its local tier the daemons' memory) in "
                    "process %d; unset %s to use Orbax's", EMERGENCY, os.getpid(), ENV)


def _dispatching(ours: type, original: type) -> type:
    """bubblesnap's manager, except when code inside Orbax builds one: that gets Orbax's
    own (logged once per building module, with where)."""
    told: set[str] = set()

    class CheckpointManager(ours):
        def __new__(cls, *args, **kwargs):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if cls is CheckpointManager and module.startswith("orbax."):
                if _building_ours(caller):
                    return original(*args, **kwargs)  # replaced at once (training.py)
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


def _building_ours(frame) -> bool:
    """Whether ``frame`` is Orbax v1's Checkpointer constructor running for bubblesnap's
    subclass (which puts its own manager in place of the one Orbax builds)."""
    training = sys.modules.get("bubblesnap.clients.jax.training")
    return training is not None and isinstance(frame.f_locals.get("self"),
                                               training.Checkpointer)


class _OrbaxFinder(importlib.abc.MetaPathFinder):
    """Finds ``orbax.checkpoint`` and Orbax v1's training modules as the other finders do,
    and patches each once it ran."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET and fullname not in V1_NAMES:
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
        if module.__name__ in V1_NAMES:
            _patch_v1(module.__name__)
        else:
            _patch()
