"""``CheckpointManagerOptions``: Orbax's, field for field (the class is Orbax's own
dataclass, subclassed), then bubblesnap's; and bubblesnap's settings of a manager given
Orbax's own options (what a framework builds), from the environment.

It is not frozen, unlike bubblesnap's other options: Orbax's manager assigns fields of
the options it is given (``async_options`` of a legacy ``checkpointers=`` manager), so a
frozen subclass would break Orbax's own code.
"""

import dataclasses
import os

import orbax.checkpoint as ocp

from bubblesnap.clients.options import ClientOptions
from bubblesnap.shared import checkpoint_record
from bubblesnap.shared.launch_env import MEMORY_INTERVAL_ENV
from bubblesnap.shared.options import require


def _memory_interval_from_env() -> int:
    value = os.environ.get(MEMORY_INTERVAL_ENV, "").strip()
    if not value:
        return 0
    try:
        interval = int(value)
    except ValueError:
        raise ValueError(f"${MEMORY_INTERVAL_ENV}={value!r}: give a whole number of steps "
                         "(0: off)") from None
    if interval < 0:
        raise ValueError(f"${MEMORY_INTERVAL_ENV}={value!r} must be >= 0 (0: off)")
    return interval


@dataclasses.dataclass(kw_only=True)
class CheckpointManagerOptions(ocp.CheckpointManagerOptions):
    """Orbax's ``CheckpointManagerOptions`` (every field, default and meaning: the steps
    its save decision and preservation policies keep are the steps written to
    ``directory``, as Orbax writes them), then bubblesnap's:

    Attributes:
      client: how to reach this host's daemon (``ClientOptions``: its address,
        default ``$BUBBLESNAP_DAEMON`` or the daemon's default socket; deadlines).
      memory_interval_steps: also snapshot every N-th step into the daemons' memory
        only, between the steps the policy saves (the local tier of Orbax's
        emergency manager: such a step is listed by ``all_steps``/``latest_step``
        while the daemons hold it, restored from there, never written to disk).
        0: off. Default ``$BUBBLESNAP_MEMORY_INTERVAL_STEPS``, else 0.
      record_bytes: the room in each item's snapshot for what is not an array (its
        tree, Python scalars, strings, shardings); keep it the same for a job's
        life. Default 1 MiB (a pytree of about 10,000 leaves).
    """

    client: ClientOptions = dataclasses.field(default_factory=ClientOptions)
    memory_interval_steps: int = dataclasses.field(default_factory=_memory_interval_from_env)
    record_bytes: int = checkpoint_record.DEFAULT_CAPACITY

    def __post_init__(self):
        super().__post_init__()
        require(self, "client", isinstance(self.client, ClientOptions), "a ClientOptions")
        require(self, "memory_interval_steps", isinstance(self.memory_interval_steps, int)
                and self.memory_interval_steps >= 0, "an int >= 0 (0: off)")
        require(self, "record_bytes", isinstance(self.record_bytes, int)
                and 4096 <= self.record_bytes <= 1 << 30, "an int from 4096 to 2**30")


def bubblesnap_settings(options) -> CheckpointManagerOptions:
    """bubblesnap's fields for a manager given ``options``: ours as they are; Orbax's own
    options (or none) get bubblesnap's defaults (the environment says the daemon and the
    memory interval)."""
    if isinstance(options, CheckpointManagerOptions):
        return options
    return CheckpointManagerOptions()
