"""How a client reaches its daemon.

Options are frozen, keyword-only dataclasses that check themselves when
made, so a wrong value fails where it is written, naming the option, instead
of deep inside a training step.
"""

import dataclasses
import os

from bubblesnap.shared.options import is_number, require
from bubblesnap.shared.trainer_api import DAEMON_ENV, DEFAULT_ADDRESS, TOKEN_ENV


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientOptions:
    """How a client reaches its daemon and how patient it is.

    Attributes:
      daemon: address of the local daemon: its Unix socket (``unix:PATH``) or
        ``host:port``. Default $BUBBLESNAP_DAEMON when set (so a launcher can
        point code it does not change at a daemon), else this user's daemon's
        socket, where a daemon listens unless told otherwise
        (``trainer_api.DEFAULT_ADDRESS``).
      token: the trainer token, sent with every call; a daemon reached over
        TCP refuses the calls that drop snapshots (a restore that is not
        ``alone``) without it. Default: $BUBBLESNAP_TRAINER_TOKEN when the
        client connects. Not needed on the Unix socket.
      rpc_timeout_seconds: deadline of each call, > 0. Default 5 s.
      backoff_seconds: after the daemon timed out or was unreachable, how long
        snapshots are skipped without asking it again, >= 0. Default 10 s.
      verify_restore: recompute checksums of restored bytes in the client too
        (the daemon checks them right before it hands a step over, and never
        writes that memory again; without it, regions the daemon cuts for
        another mesh are not hashed for the answer). Default False.
      show_progress: a progress bar on stderr (bytes, rate, time left) for a
        restore that takes more than half a second, as the daemon reads the
        copy from a peer or the durable tier. Default False (many processes of
        one job would each draw one).
      restore_timeout_seconds: deadline of a restore, which may pull the
        state from a peer or the durable tier first, > 0. Default 300 s.
      commit_timeout_seconds: how long ``snapshot(..., wait="job")`` waits for
        the whole job to commit the step (every rank's copy, with its
        replicas), > 0. Default 60 s.
      sick_after_seconds: a snapshot that does not wait (``wait=False``)
        and finds the last one not answered yet waits for it while the daemon
        runs, and is skipped at once when the daemon is stopped (SIGSTOP) or
        dead. Where this process sees the daemon's (the same pid namespace)
        the kernel says which; elsewhere (a trainer in another container) a
        daemon whose heartbeat, a clock it writes into shared memory every
        10 ms, is older than this is taken for frozen, > 0. Default 0.5 s: a
        busy daemon's clock on an overloaded host was seen up to 0.52 s late.
      persist_timeout_seconds: a CheckpointManager's step its policy keeps is
        written by the daemon; its save fails (raised by the next ``save`` or
        ``wait_until_finished``, as Orbax raises a failed save) when the daemon
        stays stopped or silent this long meanwhile (at once when it is gone), or
        when the step's folder does not appear within it, > 0. Default 60 s.
      persist_wait_floor_seconds, persist_wait_factor: how long that save waits
        for its daemon before Orbax writes the step itself in the trainer, as plain
        Orbax would (a daemon frozen, cut off or dead costs a step no more than this
        and Orbax's own write): ``persist_wait_factor`` times what the daemon's
        recent writes of the item took, and at least the floor, which also bounds
        each call to the daemon in the save's blocking part (the copy's commit, the
        write's request). Both > 0. Defaults 2 s and 4. (A process of a job of
        several processes writes its part only through its daemon: the parts must
        be cut alike; it waits up to ``persist_timeout_seconds``.)
    """

    daemon: str = dataclasses.field(
        default_factory=lambda: os.environ.get(DAEMON_ENV) or DEFAULT_ADDRESS)
    token: str = dataclasses.field(default="", repr=False)
    rpc_timeout_seconds: float = 5.0
    backoff_seconds: float = 10.0
    verify_restore: bool = False
    show_progress: bool = False
    restore_timeout_seconds: float = 300.0
    commit_timeout_seconds: float = 60.0
    sick_after_seconds: float = 0.5
    persist_timeout_seconds: float = 60.0
    persist_wait_floor_seconds: float = 2.0
    persist_wait_factor: float = 4.0

    def __post_init__(self):
        require(self, "daemon", isinstance(self.daemon, str) and bool(self.daemon),
                     "an address such as unix:///path/daemon.sock or 127.0.0.1:7070")
        if not isinstance(self.token, str):
            raise ValueError(f"ClientOptions.token must be a string (empty: ${TOKEN_ENV})")
        for name in ("rpc_timeout_seconds", "restore_timeout_seconds", "commit_timeout_seconds",
                     "sick_after_seconds", "persist_timeout_seconds",
                     "persist_wait_floor_seconds", "persist_wait_factor"):
            value = getattr(self, name)
            require(self, name, is_number(value) and value > 0, "> 0")
        require(self, "backoff_seconds",
                     is_number(self.backoff_seconds) and self.backoff_seconds >= 0, ">= 0")
        require(self, "show_progress", isinstance(self.show_progress, bool), "True or False")
        require(self, "verify_restore", isinstance(self.verify_restore, bool),
                     "True or False")
