"""The restore path: which step, from where, and how the bytes reach the caller.

restorer.py is the entry point (:class:`Restorer`: the step every rank can restore, from
memory, a peer or the durable tier); region_plan.py (pure) says which shards fill each
region asked, assembly.py reads them, verified, and region_cut.py cuts them into the
answer; answer_segment.py names the answer's segment early to the caller, phases.py
records where a restore's time went. The store, the peers and the durable reader time
their parts and name segments through the last two.
"""

from bubblesnap.service.restore.restorer import CorruptCopy, Restored, Restorer

__all__ = ["CorruptCopy", "Restored", "Restorer"]
