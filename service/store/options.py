"""What the store may hold and for how long."""

import dataclasses

from bubblesnap.shared.options import require


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """How much the store may hold and for how long (``bubblesnap daemon`` flags in brackets).

    Attributes:
      memory_budget_bytes: shared memory the store may use, pooled segments
        included (``--memory-budget``). Default 4 GiB.
      keep_steps: committed steps kept per job; older ones are freed once a
        newer step commits (``--keep``). Default 2, so the step before the
        newest survives while the newest is restored. With peers, a rank also
        keeps at most ``keep_steps + 2`` uncommitted copies (retention.py).
      checksum_threads: threads that hash shards in parallel, cut the regions of a
        restore assembled from several copies and pre-fault a fresh segment the
        daemon fills (``--checksum-threads``; a commit's hashing, when it has any,
        waits behind such work). Default 2.
      uncommitted_grace_seconds: with peers, how long a copy the group has not
        committed yet is kept before the cap on uncommitted copies may free it
        (retention.py): longer than the group's view takes to see a commit
        (``--refresh`` 1 s, twice), so a step another daemon just reported
        committed is not freed here first. Default 3 s.
      verify_on_commit: re-hash a commit's bytes even when the client sent
        checksums (``--verify-on-commit``). Off by default: the client hashes
        the bytes it wrote into shared memory inside its bubbles, where the
        core is idle anyway, and every copy is verified again before it is
        served.
      warm_pool_bytes: pre-faulted segments kept ready for bytes that arrive
        (``--warm-pool-bytes``, warm_pool.py): a peer's copy, an assembled or
        durable restore, a first snapshot lands in one at memcpy speed
        instead of paying page faults under the copy. Counted in the memory
        budget, and made only where it leaves room. Size it to the largest
        copy this daemon restores (one rank's state: a replacement host
        restores from a peer before anything else). Default 0: none, since
        these are real pages taken from the host at start, which a daemon
        that never restores would hold for nothing.
    """

    memory_budget_bytes: int = 4 << 30
    keep_steps: int = 2
    checksum_threads: int = 2
    uncommitted_grace_seconds: float = 3.0
    verify_on_commit: bool = False
    warm_pool_bytes: int = 0

    def __post_init__(self):
        require(self, "memory_budget_bytes", self.memory_budget_bytes >= 1, "positive",
                "--memory-budget")
        require(self, "keep_steps", self.keep_steps >= 1, "at least 1", "--keep")
        require(self, "checksum_threads", self.checksum_threads >= 1, "at least 1",
                "--checksum-threads")
        require(self, "uncommitted_grace_seconds", self.uncommitted_grace_seconds >= 0, ">= 0")
        require(self, "warm_pool_bytes", self.warm_pool_bytes >= 0, ">= 0", "--warm-pool-bytes")
