"""Addresses a peer hands this daemon (a Join's, a data channel's): checked before they are dialled.

They end up in channel targets and log lines, so a peer (or whoever reaches
the peer port) must not be able to pass a URL scheme, a Unix socket path, a
port out of range or a megabyte of text.
"""

import re

from bubblesnap.service.errors import InvalidArgument

#: 253 characters of DNS name (or a bracketed IPv6 address), ':' and 5 digits.
MAX_LENGTH = 261

# A host name or IPv4 address (letters, digits, '-', '.', '_'), or a bracketed IPv6 one,
# then a port of 1 to 5 digits.
_ADDRESS = re.compile(r"(?:[A-Za-z0-9_.-]{1,253}|\[[0-9A-Fa-f:.%]{2,60}\]):([0-9]{1,5})",
                      re.ASCII)


def check_address(address: str, what: str) -> None:
    """InvalidArgument naming ``what`` unless ``address`` is host:port, a port in
    1..65535, at most ``MAX_LENGTH`` characters."""
    shown = repr(address[:80]) + ("..." if len(address) > 80 else "")
    if len(address) > MAX_LENGTH:
        raise InvalidArgument(f"{what} {shown} is {len(address)} characters long, more than "
                              f"the {MAX_LENGTH} of host:port")
    match = _ADDRESS.fullmatch(address)
    if match is None or not 0 < int(match.group(1)) < 65536:
        raise InvalidArgument(f"{what} {shown} is not host:port (a host name, an IPv4 "
                              "address or a bracketed IPv6 one, and a port from 1 to 65535)")
