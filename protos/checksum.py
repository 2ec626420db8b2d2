"""The checksum named by the wire contract: xxh3_64 over a shard's raw bytes.

xxh3 hashes at memory speed (~31 GB/s measured on the dev VM, against ~4 GB/s
for zlib.crc32), so verifying every copy before it is served costs little.
"""

import itertools

import xxhash

ALGORITHM = "xxh3_64"

#: Bytes copied and hashed at a time when a copy is fused with its checksum: a
#: block this size is still in cache when it is hashed right after the copy.
FUSED_BLOCK_BYTES = 1 << 20


def checksum(buffer) -> int:
    """xxh3_64 of a bytes-like object (numpy arrays must be C-contiguous)."""
    return xxhash.xxh3_64_intdigest(buffer)


def new_hasher():
    """A streaming xxh3_64 state: feed it a shard's bytes in order, in any pieces."""
    return xxhash.xxh3_64()


def copy_hashing(dst, src, hasher, stop_early=None) -> int:
    """Copies ``src`` into ``dst`` (equal-length uint8 numpy views), feeding ``hasher``.

    Hashes each block right after copying it, while it is still in cache, and
    hashes the destination: the checksum is of the bytes that landed. If
    ``stop_early()`` turns true between blocks, stops there. Returns the bytes
    copied (a prefix of ``src``).
    """
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into a {dst.nbytes}-byte slot")
    for start in range(0, src.nbytes, FUSED_BLOCK_BYTES):
        if stop_early is not None and stop_early():
            return start
        stop = min(start + FUSED_BLOCK_BYTES, src.nbytes)
        dst[start:stop] = src[start:stop]
        hasher.update(dst[start:stop])
    return src.nbytes


def checksum_with_runs(data, runs) -> tuple[int, list[int]]:
    """The checksum of ``data`` (a uint8 numpy view) and of each (offset, nbytes) run in
    it, reading it once: each block is fed to every hash it belongs to while in cache. A
    run of all of ``data`` is the checksum of ``data``, not hashed twice (hashing a run
    again in cache took 55% longer than ``data`` alone)."""
    whole_run = (0, data.nbytes)
    parts = [run for run in runs if tuple(run) != whole_run]
    if not parts:
        value = checksum(data)
        return value, [value] * len(runs)
    whole, hashers = new_hasher(), [new_hasher() for _ in parts]
    cuts = sorted({0, data.nbytes, *(o for o, _ in parts), *(o + n for o, n in parts),
                   *range(0, data.nbytes, FUSED_BLOCK_BYTES)})
    for start, stop in itertools.pairwise(cuts):
        block = data[start:stop]
        whole.update(block)
        for (offset, nbytes), hasher in zip(parts, hashers, strict=True):
            if offset <= start and stop <= offset + nbytes:
                hasher.update(block)
    value, sums = whole.intdigest(), iter(h.intdigest() for h in hashers)
    return value, [value if tuple(run) == whole_run else next(sums) for run in runs]


class SlotHasher:
    """Checksums of the slots of a segment whose bytes arrive in order, in any pieces.

    ``slots`` are (offset, nbytes) in offset order. Feeding each received
    range right after it lands hashes it while it is still in cache, instead
    of reading the whole segment again afterwards.
    """

    def __init__(self, slots):
        self._slots = list(slots)
        self._hashers = [new_hasher() for _ in self._slots]
        self._next = 0  # first slot not yet complete

    def feed(self, segment, start: int, stop: int) -> None:
        """``segment[start:stop]`` has arrived (ranges come in order, without gaps)."""
        i = self._next
        while i < len(self._slots):
            offset, nbytes = self._slots[i]
            if offset >= stop:
                break
            lo, hi = max(start, offset), min(stop, offset + nbytes)
            if lo < hi:
                self._hashers[i].update(segment[lo:hi])
            if offset + nbytes > stop:
                break
            i += 1
        self._next = i

    def digests(self) -> tuple[int, ...]:
        return tuple(h.intdigest() for h in self._hashers)
