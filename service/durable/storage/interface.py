"""The interface of the durable tier's storage (:class:`Storage`) and the URLs that name
an object store."""

#: Schemes of object stores.
SCHEMES = ("s3", "gs")


def is_url(path: str) -> bool:
    """Whether ``path`` names an object store (``s3://``, ``gs://``)."""
    return path.split("://", 1)[0] in SCHEMES and "://" in path


def split_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of ``<scheme>://<bucket>[/<key>]``."""
    scheme, rest = url.split("://", 1)
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket")
    return scheme, bucket, key.strip("/")


class Storage:
    """What the durable tier does with its files. Paths are those ``storage.at`` took."""

    #: Whether a step is published by renaming its folder (else written at its name).
    renames: bool = False
    #: Bytes a restore reads at once from this storage (reader.py): its memory beyond
    #: what the daemon holds, against the reads that keep the storage busy.
    read_bytes_in_flight: int

    def read(self, path: str) -> bytes:
        """The file's bytes; FileNotFoundError when absent."""
        raise NotImplementedError

    def write(self, path: str, data: bytes) -> None:
        """Writes ``path`` whole or not at all, durably."""
        raise NotImplementedError

    def create(self, path: str, data: bytes) -> bool:
        """Writes ``path`` only if it does not exist; whether it did."""
        raise NotImplementedError

    def modified(self, path: str) -> float | None:
        """When ``path`` was last written (seconds since the epoch); None when absent."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        """Whether the file ``path`` exists."""
        return self.modified(path) is not None

    def holds_any(self, folder: str) -> bool:
        """Whether anything lies under ``folder``."""
        raise NotImplementedError

    def names(self, folder: str, folders: bool = False) -> list[str]:
        """The names one level under ``folder`` (only the folders, with ``folders``);
        [] when none."""
        raise NotImplementedError

    def stamp(self, folder: str) -> int | None:
        """A value that changes whenever ``folder``'s names do, to cache a listing by;
        None: list afresh each time."""
        return None

    def remove(self, path: str) -> None:
        """Removes the file, or everything under the folder, ``path`` (absent: nothing)."""
        raise NotImplementedError

    def rename(self, source: str, target: str) -> None:
        """Moves a folder (only where ``renames``); OSError when ``target`` exists."""
        raise NotImplementedError

    def make_folder(self, folder: str) -> None:
        """Makes ``folder`` and its parents, where folders exist."""

    def kvstore(self, path: str) -> dict:
        """TensorStore's kvstore spec for the folder ``path`` (a trailing slash)."""
        raise NotImplementedError
