"""The snapshot store: what this daemon holds in shared memory, and its rules.

``SnapshotStore`` (store.py) is the one entry; ``StoreOptions`` its options.
The parts under it: model (jobs, ranks, copies), layout (validation),
segments and memory (shared memory, budget, pins), persistence (each held
copy's record beside its segment) and adoption (a killed daemon's copies taken
over at start), registration, staging (begin and commit), reads (serve, pin),
arrivals (copies from peers or disk, rollback), retention (pure), views (what
the store answers).
"""

from bubblesnap.service.store.options import StoreOptions
from bubblesnap.service.store.store import SnapshotStore

__all__ = ["SnapshotStore", "StoreOptions"]
