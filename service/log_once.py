"""Warnings about the same thing said once, not on every pass that meets it again.

A key someone else wrote under the group's etcd prefix is met by every read of
the prefix (several a second); one line per key tells the operator, a line per
read buries the log. The memory of what was said is bounded: past
``_REMEMBERED`` distinct things the oldest is forgotten (and may be said again).
"""

import collections
import logging
import threading

_REMEMBERED = 1024

_said: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def warn_once(log: logging.Logger, about: str, message: str, *args) -> None:
    """``log.warning(message, *args)`` the first time ``about`` is warned about."""
    with _lock:
        if about in _said:
            return
        _said[about] = None
        if len(_said) > _REMEMBERED:
            _said.popitem(last=False)
    log.warning(message, *args)
