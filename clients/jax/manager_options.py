"""``CheckpointManagerOptions``: every field of Orbax's, with Orbax's defaults and meaning,
then ours; and the save and preservation policies they make (Orbax's own policy classes).

The manager takes these options or Orbax's own ``ocp.CheckpointManagerOptions``
(what a framework builds before it calls ``ocp.CheckpointManager``): both
become one :class:`CheckpointManagerOptions` (:func:`resolve`). An option
that has no meaning for a checkpoint held by a daemon (how Orbax deletes or
creates folders on its own) is accepted and named in one warning.
"""

import dataclasses
import datetime
import logging
from collections.abc import Callable, Container

import orbax.checkpoint as ocp

from bubblesnap import checkpoint_record
from bubblesnap.clients.options import ClientOptions
from bubblesnap.options import require

log = logging.getLogger("bubblesnap.client")
policies = ocp.checkpoint_managers

#: Options Orbax uses for how it writes, lists and deletes folders itself; here the
#: daemon writes and the folders are Orbax's standard ones, so they change nothing.
NO_MEANING = ("cleanup_tmp_directories", "single_host_load_and_broadcast", "todelete_subdir",
              "todelete_full_path", "enable_background_delete", "num_deletion_threads",
              "file_options", "atomicity_options", "temporary_path_class",
              "enable_per_process_directory_creation", "lightweight_initialize")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointManagerOptions:
    """Orbax's ``CheckpointManagerOptions`` (same names, defaults and meaning), then ours.

    Orbax's, as bubblesnap applies them:
      save_interval_steps, save_on_steps, should_save_fn, save_decision_policy:
        which steps ``save`` takes (Orbax's save decision policies, built as
        Orbax builds them; a snapshot into memory is cheap, so 1 is a fine
        interval).
      max_to_keep, keep_period, keep_time_interval, best_fn, best_mode,
        keep_checkpoints_without_metrics, preservation_policy: which saved steps
        ``all_steps`` keeps (Orbax's preservation policies); the others are
        deleted from the daemons' memory and the durable tier. Memory also holds
        no more than the daemon's ``--keep`` newest steps: a step the policy keeps
        stays restorable as long as a tier holds it.
      step_prefix, step_format_fixed_length: the step folders' names
        (``<prefix>_<step>``, zero padded), written by the daemon and read.
      step_name_format: Orbax's NameFormat, used to find steps Orbax wrote
        (the daemon names its own with ``step_prefix`` and
        ``step_format_fixed_length``).
      create: make ``directory`` if it is missing (else it must exist).
      read_only: ``save`` and ``delete`` do nothing (with a warning).
      enable_async_checkpointing: True: ``save`` returns once the state is in the
        daemon's memory; False: it waits until the whole job committed the step.
      async_options: its ``timeout_secs`` bounds ``wait_until_finished``'s wait for a
        commit; ``post_finalization_callback`` runs once a save is committed.
      multiprocessing_options: ``primary_host`` is the process that writes and
        deletes the manager's folders (JSON and Orbax-handler items, retired steps).
      prevent_write_metrics: metrics are not kept with the step.
      save_root_metadata: the constructor's ``metadata`` is written once, as Orbax's.
      enable_should_save_is_saving_in_progress_check: as Orbax (a save is in
        progress until the daemon committed it).
      The rest (``NO_MEANING``) is accepted and named in one warning.

    Ours:
      client: how to reach the daemon (socket, deadlines).
      record_bytes: the room in each step for everything that is not an array
        (scalars, strings, JSON items, metadata); an item that does not fit is
        saved by Orbax's own handler into the step's folder instead.
    """

    save_interval_steps: int = 1
    max_to_keep: int | None = None
    keep_time_interval: datetime.timedelta | None = None
    keep_period: int | None = None
    best_fn: Callable | None = None
    best_mode: str = "max"
    keep_checkpoints_without_metrics: bool = True
    step_prefix: str | None = None
    step_format_fixed_length: int | None = None
    step_name_format: object = None
    create: bool = True
    cleanup_tmp_directories: bool = False
    save_on_steps: Container[int] | None = None
    single_host_load_and_broadcast: bool = False
    todelete_subdir: str | None = None
    todelete_full_path: str | None = None
    enable_background_delete: bool = False
    num_deletion_threads: int | None = None
    read_only: bool = False
    enable_async_checkpointing: bool = True
    async_options: object = None
    multiprocessing_options: object = dataclasses.field(
        default_factory=ocp.options.MultiprocessingOptions)
    should_save_fn: Callable | None = None
    file_options: object = dataclasses.field(default_factory=ocp.options.FileOptions)
    atomicity_options: object = None
    save_root_metadata: bool = True
    temporary_path_class: object = None
    save_decision_policy: object = None
    preservation_policy: object = None
    prevent_write_metrics: bool = False
    enable_should_save_is_saving_in_progress_check: bool = True
    enable_per_process_directory_creation: bool = False
    lightweight_initialize: bool = False
    client: ClientOptions = dataclasses.field(default_factory=ClientOptions)
    record_bytes: int = checkpoint_record.DEFAULT_CAPACITY

    def __post_init__(self):
        require(self, "save_interval_steps", isinstance(self.save_interval_steps, int) and (
            self.save_interval_steps >= 1 or (self.read_only and self.save_interval_steps == 0)),
            "an int >= 1 (0 only with read_only)")
        require(self, "max_to_keep", self.max_to_keep is None or (
            isinstance(self.max_to_keep, int) and self.max_to_keep >= 0), "None or an int >= 0")
        require(self, "keep_period", self.keep_period is None or (
            isinstance(self.keep_period, int) and self.keep_period >= 1), "None or an int >= 1")
        require(self, "best_mode", self.best_mode in ("min", "max"), "'min' or 'max'")
        require(self, "record_bytes", isinstance(self.record_bytes, int)
                and 4096 <= self.record_bytes <= 1 << 30, "an int from 4096 to 2**30")
        require(self, "preservation_policy", self.preservation_policy is None or not (
            self.max_to_keep or self.keep_period or self.keep_time_interval),
            "not given with max_to_keep, keep_period or keep_time_interval (Orbax: they are "
            "mutually exclusive)")
        try:
            checkpoint_record.step_dir_name(0, self.step_prefix, self.step_format_fixed_length)
        except ValueError as err:
            raise ValueError(f"CheckpointManagerOptions: {err}") from None

    def changed_without_meaning(self) -> list[str]:
        """The options set away from Orbax's defaults that change nothing here."""
        defaults = CheckpointManagerOptions()
        return [name for name in NO_MEANING if getattr(self, name) != getattr(defaults, name)]


def resolve(options) -> CheckpointManagerOptions:
    """Ours as they are; Orbax's ``CheckpointManagerOptions`` field by field (fields
    this version does not know are named in the warning); None: the defaults. Warns
    once naming the options that change nothing here."""
    if options is None:
        options = CheckpointManagerOptions()
    elif not isinstance(options, CheckpointManagerOptions):
        if not dataclasses.is_dataclass(options):
            raise TypeError(f"options must be CheckpointManagerOptions (bubblesnap's or "
                            f"Orbax's), got {type(options).__name__}")
        known = {f.name for f in dataclasses.fields(CheckpointManagerOptions)}
        given = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        unknown = sorted(set(given) - known)
        if unknown:
            log.warning("CheckpointManagerOptions: %s are not known to bubblesnap's manager "
                        "and have no effect", ", ".join(unknown))
        given = {k: v for k, v in given.items() if k in known}
        options = CheckpointManagerOptions(**given)
    ignored = options.changed_without_meaning()
    if ignored:
        log.warning("CheckpointManagerOptions: %s have no effect with bubblesnap (the daemon "
                    "writes, lists and deletes the step folders)", ", ".join(ignored))
    return options


class _ShouldSaveFn(policies.SaveDecisionPolicy):
    """Orbax's reading of ``should_save_fn(step, last saved step or None)``."""

    def __init__(self, fn):
        self._fn = fn

    def should_save(self, step, previous_steps, *, context) -> bool:
        del context
        return bool(self._fn(step.step, previous_steps[-1].step if previous_steps else None))


def save_decision_policy(options: CheckpointManagerOptions):
    """Which steps to save: ``save_decision_policy``, else what Orbax builds from
    ``should_save_fn`` or ``save_interval_steps`` and ``save_on_steps`` (each with
    preemption; the interval ones with the first save of a fresh run)."""
    if options.save_decision_policy is not None:
        return options.save_decision_policy
    if options.should_save_fn is not None:
        chosen = [_ShouldSaveFn(options.should_save_fn)]
    else:
        chosen = []
        if options.save_interval_steps:
            chosen.append(policies.FixedIntervalPolicy(options.save_interval_steps))
        if options.save_on_steps:
            chosen.append(policies.SpecificStepsPolicy(frozenset(options.save_on_steps)))
        chosen.append(policies.InitialSavePolicy())
    return policies.AnySavePolicy([*chosen, policies.PreemptionCheckpointingPolicy()])


def preservation_policy(options: CheckpointManagerOptions):
    """Which saved steps to keep: ``preservation_policy``, else what Orbax builds from
    ``keep_period``, ``keep_time_interval``, ``best_fn`` and ``max_to_keep``."""
    if options.preservation_policy is not None:
        return options.preservation_policy
    chosen = []
    if options.keep_period is not None:
        chosen.append(policies.EveryNSteps(options.keep_period))
    if options.keep_time_interval is not None:
        chosen.append(policies.EveryNSeconds(
            interval_secs=int(options.keep_time_interval.total_seconds())))
    if options.best_fn is not None:
        chosen.append(policies.BestN(
            get_metric_fn=options.best_fn, reverse=options.best_mode == "min",
            n=options.max_to_keep,
            keep_checkpoints_without_metrics=options.keep_checkpoints_without_metrics))
    else:
        chosen.append(policies.LatestN(n=options.max_to_keep))
    return policies.AnyPreservationPolicy(chosen)


def asks_saving_in_progress(policy) -> bool:
    """Whether a save decision policy reads ``is_saving_in_progress`` (continuous
    checkpointing; the manager asks the daemon only then)."""
    if isinstance(policy, policies.AnySavePolicy):
        return any(asks_saving_in_progress(p) for p in policy.policies)
    return isinstance(policy, policies.ContinuousCheckpointingPolicy)


def step_naming(options: CheckpointManagerOptions) -> tuple[str | None, int | None]:
    """(prefix, fixed length) of the step folders: ``step_name_format``'s when it is
    Orbax's standard one, else ``step_prefix`` and ``step_format_fixed_length`` (the
    daemon names its steps with these; another format is named in a warning)."""
    name_format = options.step_name_format
    if name_format is None:
        return options.step_prefix, options.step_format_fixed_length
    if hasattr(name_format, "step_prefix") and hasattr(name_format,
                                                       "step_format_fixed_length"):
        return name_format.step_prefix, name_format.step_format_fixed_length
    log.warning("CheckpointManagerOptions.step_name_format %s is not Orbax's standard one: "
                "the daemon names the steps it writes with step_prefix=%r and "
                "step_format_fixed_length=%r", type(name_format).__name__,
                options.step_prefix, options.step_format_fixed_length)
    return options.step_prefix, options.step_format_fixed_length
