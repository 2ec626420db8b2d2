"""Where the durable tier's files live: a POSIX folder or an object store (``s3://``,
``gs://``), behind one interface.

Every path the durable code handles is a string: an absolute POSIX path or a URL
``<scheme>://<bucket>/<key>``; :func:`at` gives the storage that holds it. Paths are
joined with ``posixpath.join`` whichever they are. The two differ where object stores
have no folders:

- a POSIX folder publishes a step by renaming it (``renames``); an object store has no
  rename, so a step is written at its final name and counts only once marked whole
  (format.py);
- a POSIX folder's listing has an mtime to cache it by (``stamp``); an object store is
  listed afresh;
- a lock is a file created exclusively (``O_EXCL``) or an object put only if absent
  (``If-None-Match: *``); its age is its mtime or the store's ``LastModified``.

Object stores are object_storage.py (S3 through obstore, GCS through gcsfs: it says
why), reached as object_config.py says. TensorStore, which writes the arrays (Orbax's
own path), is given the same endpoint explicitly (:meth:`Storage.kvstore`): its s3
driver ignores ``AWS_ENDPOINT_URL``.
"""

import functools
import os
import shutil
import uuid

#: Schemes of object stores.
SCHEMES = ("s3", "gs")


def is_url(path: str) -> bool:
    """Whether ``path`` names an object store (``s3://``, ``gs://``)."""
    return path.split("://", 1)[0] in SCHEMES and "://" in path


def at(path: str) -> "Storage":
    """The storage holding ``path``. ValueError for a URL of a scheme not supported or
    with no bucket."""
    if not is_url(path):
        if "://" in path:
            raise ValueError(f"{path!r}: durable storage is a POSIX folder, s3://BUCKET[/PREFIX]"
                             " or gs://BUCKET[/PREFIX]")
        return _POSIX
    from bubblesnap.service.durable import object_config

    scheme, bucket, _ = split_url(path)
    # one client per bucket and settings (the environment may name another server later)
    return _object_storage(scheme, bucket, object_config.settings(scheme, os.environ))


def split_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of ``<scheme>://<bucket>[/<key>]``."""
    scheme, rest = url.split("://", 1)
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket")
    return scheme, bucket, key.strip("/")


class Storage:
    """What the durable tier does with its files. Paths are those :func:`at` took."""

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


class PosixStorage(Storage):
    """A folder on a filesystem every host sees (or one host's disk)."""

    renames = True
    #: TensorStore reads each chunk into buffers of its own (the file's bytes, then
    #: decoded) until it lands, so this bounds the daemon's memory beyond what it holds.
    #: A 1 GB restore on the 2-core dev VM, the reading daemon holding 2.05 GB: all at
    #: once, its peak RSS passed what it held by 1.62 GB. Every bound tried read as fast
    #: (624-674 ms a restore); the peak RSS was 2.70-2.81 GB with 256 MB in flight (64 MB
    #: pieces), and in 16 MiB pieces 2.64-2.65 GB with 128 MB, 2.47-2.56 GB with 64 MB,
    #: 2.43 GB with 32 MB (fewer cores busy: 1.75 against 1.9).
    read_bytes_in_flight = 64 << 20

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write(self, path: str, data: bytes) -> None:
        # A private temporary file, fsynced, then renamed: a reader (or a second
        # daemon writing the same file) never sees half of it.
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def create(self, path: str, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def modified(self, path: str) -> float | None:
        try:
            return os.stat(path).st_mtime
        except (FileNotFoundError, NotADirectoryError):
            return None

    def holds_any(self, folder: str) -> bool:
        return os.path.isdir(folder)

    def names(self, folder: str, folders: bool = False) -> list[str]:
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            return []
        if folders:
            return [n for n in names if os.path.isdir(os.path.join(folder, n))]
        return names

    def stamp(self, folder: str) -> int | None:
        try:
            return os.stat(folder).st_mtime_ns
        except (FileNotFoundError, NotADirectoryError):
            return None

    def remove(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def rename(self, source: str, target: str) -> None:
        os.rename(source, target)

    def make_folder(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)

    def kvstore(self, path: str) -> dict:
        return {"driver": "file", "path": path.rstrip("/") + "/"}


_POSIX = PosixStorage()


@functools.lru_cache(maxsize=64)
def _object_storage(scheme: str, bucket: str, settings) -> Storage:
    from bubblesnap.service.durable import object_config

    return object_config.storage(scheme, bucket, settings)
