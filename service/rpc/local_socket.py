"""The trainer API's Unix socket: owner-only, in a folder no other user controls.

The socket file is created with mode 0600 (under a umask set around the
bind), so only this user (and root) can connect. Its folder is made 0700 if
it does not exist; one that exists must belong to this user or root, or
another user could swap the socket for their own and talk to our trainers.
gRPC replaces whatever socket file is in the way, so a live daemon's socket
is checked for first: a second daemon on it must fail, not take it over.
gRPC removes the file when the server stops; one a killed daemon left is
replaced.
"""

import contextlib
import os
import socket
import stat


class SocketError(RuntimeError):
    """The socket cannot be made there; the message says why and what to do."""


def prepare(path: str) -> None:
    """Makes ``path`` ready to bind: its folder exists and is safe, nobody listens there."""
    if len(os.fsencode(path)) > 107:  # sun_path holds 108 bytes with the NUL
        raise SocketError(f"{path} is longer than a Unix socket path may be (107 bytes)")
    folder = os.path.dirname(os.path.abspath(path))
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid not in (os.getuid(), 0):
        raise SocketError(f"{folder} is not a folder of this user's (uid {os.getuid()}) or "
                          "root's: another user could replace the socket; remove it or pick "
                          "another path")
    try:
        existing = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(existing.st_mode):
        raise SocketError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return  # a daemon that was killed left it behind
    raise SocketError(f"another daemon listens on {path}")


@contextlib.contextmanager
def owner_only():
    """While binding: files are created readable and writable by their owner only.
    (The umask is the process's: nothing else creates files while the daemon starts.)"""
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)

