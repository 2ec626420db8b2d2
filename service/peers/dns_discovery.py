"""Asking DNS which daemons a headless Service lists, until the answer is one to take.

The decision (the order, this daemon's index, whether an answer will do) is
discovery.py's; this is the asking and the waiting. The resolver is a
parameter so a test can play a Service whose pods come and go.
"""

import logging
import socket
import time

from bubblesnap.service.peers.discovery import DiscoveryOptions, ring, waiting_for

log = logging.getLogger("bubblesnap.daemon")


class DiscoveryError(RuntimeError):
    """The Service never listed a ring this daemon could take; the message says what it saw."""


def resolve(name: str) -> list[str]:
    """The IP addresses DNS gives for ``name``; none while the name does not exist yet (a
    headless Service has no records before its first pod has an address)."""
    try:
        return [info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)]
    except socket.gaierror:
        return []


def discover(options: DiscoveryOptions, resolver=resolve, clock=time.monotonic,
             sleep=time.sleep) -> tuple[tuple[str, ...], int]:
    """The ring's peer addresses and this daemon's index, once the Service has listed the
    expected daemons, this one among them, unchanged for ``settle_seconds``.
    DiscoveryError after ``timeout_seconds``."""
    name = options.service.rpartition(":")[0]
    started = clock()
    last, since, reason = None, started, ""
    while True:
        listed = frozenset(resolver(name))
        now = clock()
        if listed != last:
            last, since = listed, now
            reason = waiting_for(listed, options)
            log.info("%s lists %s%s", name, sorted(listed) or "nothing",
                     f": waiting, {reason}" if reason else "")
        if not reason and now - since >= options.settle_seconds:
            return ring(listed, options.own_address, options.port)
        if now - started >= options.timeout_seconds:
            raise DiscoveryError(
                f"no ring from {name} after {options.timeout_seconds:g} s: "
                f"{reason or 'its answer kept changing'}")
        sleep(options.poll_seconds)
