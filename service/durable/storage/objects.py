"""The durable tier's storage in an object store: one bucket of S3 (through obstore)
or of GCS (through gcsfs), behind storage.Storage.

Why two clients: obstore (Apache Arrow's Rust ``object_store``) is the faster, smaller
S3 client, with conditional put (``If-None-Match: *``), LastModified in listings and
the AWS credential chain (environment, IRSA's web identity, instance metadata). Its
GCS client speaks GCS's XML API, which the GCS emulator the tests can run
(fake-gcs-server) does not accept for uploads, so it could not be tested; gcsfs
(fsspec's) speaks the JSON API, honours ``STORAGE_EMULATOR_HOST``, creates only if
absent (``ifGenerationMatch=0``), reads Google's application default credentials
(Workload Identity included), and is what Orbax's own ``gs://`` paths go through.

Every failure of the store (past the client's own retries) is raised as
:class:`StoreError`, an OSError, so callers handle a store and a filesystem alike; a
missing object stays FileNotFoundError.
"""

import datetime
import functools
import posixpath
import re

from bubblesnap.service.durable.storage.interface import Storage, split_url


class StoreError(OSError):
    """The object store refused a request or did not answer."""


def _as_store_errors(method):
    """The client's own errors as StoreError (FileNotFoundError and ValueError pass)."""

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except (FileNotFoundError, StoreError, ValueError):
            raise
        except Exception as err:
            raise StoreError(_first_line(err)) from err

    return wrapped


def _first_line(err: Exception) -> str:
    """The client's message without its multi-line debug chain or its timings (the same
    failure reads the same each time), with the store's error code where it gave one
    (S3's ``<Code>``)."""
    text = str(err).strip()
    first = re.sub(r" in [0-9.]+[µnm]?s\b", "", text.splitlines()[0] if text else "")
    code = re.search(r"<Code>([A-Za-z]+)</Code>", text)
    return f"{type(err).__name__}: {first[:500]}" + (f" ({code[1]})" if code else "")


class _Bucket(Storage):
    """What both object stores share: a bucket, keys from URLs, TensorStore's spec."""

    #: Each piece of a restore is a GET whose answer takes a round trip and the store's
    #: own latency: more in flight than from a filesystem keeps the store busy.
    read_bytes_in_flight = 256 << 20

    def __init__(self, scheme: str, bucket: str, kvstore_base: dict):
        self.scheme, self.bucket, self._kvstore_base = scheme, bucket, kvstore_base

    def _key(self, path: str) -> str:
        scheme, bucket, key = split_url(path)
        if (scheme, bucket) != (self.scheme, self.bucket):
            raise ValueError(f"{path!r} is not in {self.scheme}://{self.bucket}")
        return key

    def kvstore(self, path: str) -> dict:
        key = self._key(path)
        return {**self._kvstore_base, "path": key + "/" if key else ""}


class S3Storage(_Bucket):
    """A bucket of S3 (or of a store that speaks its API), through obstore."""

    def __init__(self, bucket: str, store, kvstore_base: dict):
        super().__init__("s3", bucket, kvstore_base)
        self._store = store

    @_as_store_errors
    def read(self, path: str) -> bytes:
        import obstore

        return bytes(obstore.get(self._store, self._key(path)).bytes())

    @_as_store_errors
    def write(self, path: str, data: bytes) -> None:
        import obstore

        obstore.put(self._store, self._key(path), data)  # an object appears whole

    @_as_store_errors
    def create(self, path: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            obstore.put(self._store, self._key(path), data, mode="create")
        except (AlreadyExistsError, PreconditionError):
            return False
        return True

    @_as_store_errors
    def modified(self, path: str) -> float | None:
        import obstore

        try:
            return obstore.head(self._store, self._key(path))["last_modified"].timestamp()
        except FileNotFoundError:
            return None

    @_as_store_errors
    def holds_any(self, folder: str) -> bool:
        import obstore

        for chunk in obstore.list(self._store, self._key(folder) + "/", chunk_size=1):
            return bool(chunk)
        return False

    @_as_store_errors
    def names(self, folder: str, folders: bool = False) -> list[str]:
        import obstore

        prefix = self._key(folder)
        listed = obstore.list_with_delimiter(self._store, prefix + "/" if prefix else None)
        # (a store with folders, SeaweedFS, may list an empty one as its own prefix)
        found = {posixpath.basename(p.rstrip("/")) for p in listed["common_prefixes"]
                 if p.rstrip("/") != prefix}
        if not folders:
            found |= {posixpath.basename(o["path"]) for o in listed["objects"]}
        return sorted(found)

    @_as_store_errors
    def remove(self, path: str) -> None:
        import obstore

        key = self._key(path)
        keys = [o["path"] for chunk in obstore.list(self._store, key + "/") for o in chunk]
        # A store that keeps folders (SeaweedFS) keeps them empty after their objects go,
        # listed for ever: each is deleted by its key with a trailing slash, deepest first
        # (S3 itself has none: deleting a key that is not there is no error).
        folders = {posixpath.dirname(k) for k in keys}
        folders = {f for k in folders for f in _parents(k, key)}
        keys += [key] + [f"{f}/" for f in sorted(folders, key=len, reverse=True)]
        for start in range(0, len(keys), 1000):  # S3's DeleteObjects takes up to 1000
            obstore.delete(self._store, keys[start:start + 1000])


def _parents(folder: str, top: str) -> list[str]:
    """``folder`` and each folder above it up to ``top`` (both in)."""
    found = []
    while folder.startswith(top) and len(folder) >= len(top):
        found.append(folder)
        folder = posixpath.dirname(folder)
    return found


class GcsStorage(_Bucket):
    """A bucket of GCS (or of its emulator), through gcsfs, its listings never cached
    (another daemon's writes must be seen)."""

    def __init__(self, bucket: str, fs, kvstore_base: dict):
        super().__init__("gs", bucket, kvstore_base)
        self._fs = fs

    def _object(self, path: str) -> str:
        return f"{self.bucket}/{self._key(path)}".rstrip("/")

    @_as_store_errors
    def read(self, path: str) -> bytes:
        return self._fs.cat_file(self._object(path))

    @_as_store_errors
    def write(self, path: str, data: bytes) -> None:
        self._fs.pipe_file(self._object(path), data)  # one upload: whole or absent

    @_as_store_errors
    def create(self, path: str, data: bytes) -> bool:
        try:
            self._fs.pipe_file(self._object(path), data, mode="create")
        except FileExistsError:
            return False
        return True

    @_as_store_errors
    def modified(self, path: str) -> float | None:
        try:
            info = self._fs.info(self._object(path))
        except FileNotFoundError:
            return None
        if info.get("type") != "file":
            return None
        return datetime.datetime.fromisoformat(info["updated"].replace("Z", "+00:00")).timestamp()

    @_as_store_errors
    def holds_any(self, folder: str) -> bool:
        try:
            return bool(self._fs.ls(self._object(folder), detail=False))
        except FileNotFoundError:
            return False

    @_as_store_errors
    def names(self, folder: str, folders: bool = False) -> list[str]:
        try:
            listed = self._fs.ls(self._object(folder), detail=True)
        except FileNotFoundError:
            return []
        return sorted({posixpath.basename(e["name"].rstrip("/")) for e in listed
                       if not folders or e["type"] == "directory"})

    @_as_store_errors
    def remove(self, path: str) -> None:
        name = self._object(path)
        found = self._fs.find(name) if self._fs.isdir(name) else []
        if self._fs.isfile(name):
            found.append(name)
        try:
            if found:
                self._fs.rm(found)
        except FileNotFoundError:
            pass  # another daemon removed them first (every daemon retires a job's steps)
