"""Run at Python's start-up when this folder, the bootstrap folder's old place, is on
PYTHONPATH: says where it moved (bubblesnap/run/bootstrap/) and runs the sitecustomize
there, with the moved folder on sys.path in this one's place (so the site's own
sitecustomize, which that one chains to, still runs once)."""

import importlib.util
import os
import sys

_here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
_moved = os.path.join(os.path.dirname(_here), "run", "bootstrap")
print(f"bubblesnap: {_here} on PYTHONPATH moved to {_moved} (`python -m bubblesnap.run "
      "--pythonpath` prints it); put that on PYTHONPATH instead", file=sys.stderr)
sys.path[:] = [_moved if entry and os.path.realpath(entry) == _here else entry
               for entry in sys.path]
_spec = importlib.util.spec_from_file_location("sitecustomize",
                                               os.path.join(_moved, "sitecustomize.py"))
_module = importlib.util.module_from_spec(_spec)
sys.modules["sitecustomize"] = _module
_spec.loader.exec_module(_module)
