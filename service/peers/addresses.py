"""Addresses a peer hands this daemon (a Join's, a data channel's): checked before they are dialled.

They end up in channel targets and log lines, so a peer (or whoever reaches
the peer port) must not be able to pass a URL scheme, a Unix socket path, a
port out of range or a megabyte of text.
"""

import ipaddress
import re

from bubblesnap.service.errors import InvalidArgument, shown

_PORT = re.compile(r"[0-9]{1,5}")
_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", re.ASCII)


def check_address(address: str, what: str) -> None:
    """InvalidArgument naming ``what`` unless ``address`` is host:port: the host an IP
    address ([...] around IPv6) or a DNS name (labels of 1-63 letters, digits and '-',
    253 characters in all), the port 1..65535."""
    host, _, port = address.rpartition(":")
    if not (_PORT.fullmatch(port) and 0 < int(port) < 65536 and _is_host(host)):
        raise InvalidArgument(f"{what} {shown(address)} is not host:port (a DNS name or an "
                              "IP address, [...] around IPv6, and a port 1-65535)")


def _is_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    return 0 < len(host) <= 253 and all(_HOST_LABEL.fullmatch(label)
                                        for label in host.removesuffix(".").split("."))
