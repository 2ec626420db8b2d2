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

Object stores are objects.py (S3 through obstore, GCS through gcsfs: it says
why), reached as object_config.py says. TensorStore, which writes the arrays (Orbax's
own path), is given the same endpoint explicitly (:meth:`Storage.kvstore`): its s3
driver ignores ``AWS_ENDPOINT_URL``.
"""

import functools
import os

from bubblesnap.service.durable.storage.interface import SCHEMES, Storage, is_url, split_url
from bubblesnap.service.durable.storage.posix import PosixStorage

__all__ = ["SCHEMES", "PosixStorage", "Storage", "at", "is_url", "split_url"]


def at(path: str) -> "Storage":
    """The storage holding ``path``. ValueError for a URL of a scheme not supported or
    with no bucket."""
    if not is_url(path):
        if "://" in path:
            raise ValueError(f"{path!r}: durable storage is a POSIX folder, s3://BUCKET[/PREFIX]"
                             " or gs://BUCKET[/PREFIX]")
        return _POSIX
    from bubblesnap.service.durable.storage import object_config

    scheme, bucket, _ = split_url(path)
    # one client per bucket and settings (the environment may name another server later)
    return _object_storage(scheme, bucket, object_config.settings(scheme, os.environ))


_POSIX = PosixStorage()


@functools.lru_cache(maxsize=64)
def _object_storage(scheme: str, bucket: str, settings) -> Storage:
    from bubblesnap.service.durable.storage import object_config

    return object_config.storage(scheme, bucket, settings)
