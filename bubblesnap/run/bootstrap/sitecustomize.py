"""Run at Python's start-up when this folder is on PYTHONPATH (bubblesnap/run/orbax_patch.py).

With ``BUBBLESNAP_ORBAX=1`` it puts bubblesnap's CheckpointManager behind
``orbax.checkpoint.CheckpointManager`` (when Orbax is imported); then it runs
the ``sitecustomize`` this one hides, if the environment has one, so a
site's own start-up code still runs.
"""

import importlib.util
import os
import sys


def _chain() -> None:
    if getattr(sys, "_bubblesnap_sitecustomize_chained", False):
        return  # this folder is on the path twice (a link to it): run the next one once
    sys._bubblesnap_sitecustomize_chained = True
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    for entry in sys.path:
        if not entry or os.path.realpath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_bubblesnap_next_sitecustomize",
                                                          candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


def _install() -> None:
    try:
        from bubblesnap.run import orbax_patch
    except ImportError:  # bubblesnap is not installed in this interpreter
        return
    if orbax_patch.enabled():
        orbax_patch.install()


_install()
_chain()
