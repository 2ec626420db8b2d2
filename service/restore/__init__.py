"""The restore path: which step, from where, and how the bytes reach the caller.

restorer.py is the entry point (:class:`Restorer`: the step every rank can restore, from
memory, a peer or the durable tier); region_plan.py (pure) says which shards fill each
region asked, assembly.py reads them, verified, and region_cut.py cuts them into the
answer. The answer's segment is named early to the caller through
service/answer_segment.py and where a restore's time went is recorded by
service/phases.py: both lie outside this package, since the store, the peers and the
durable reader, which this package imports, use them too.
"""

from bubblesnap.service.restore.restorer import CorruptCopy, Restored, Restorer

__all__ = ["CorruptCopy", "Restored", "Restorer"]
