"""The hooks a pipeline runtime calls each iteration, and two implementations of them.

A stage's training loop calls, per iteration::

    hooks.begin_iteration(it)
    for position, action in enumerate(schedule):
        if action needs a neighbour's tensor:
            if it has arrived: hooks.no_bubble(position)
            else:              tensor = hooks.bubble(position, receive, arrived)
        compute(action)
    hooks.end_iteration(it, state)

and ``flush()`` before it times another kind of hooks, ``close()`` at the
end. :class:`PipelineHooks` is that interface; ``BubbleSnapshotter``
(``bubblesnap.clients.jax``) snapshots in the bubbles through it,
:class:`NoSnapshots` does nothing in them, and :class:`LoggedSteps` wraps
any of them so that each step's training-log record is sent as the step
begins and waited for as it ends.
"""

import typing


@typing.runtime_checkable
class PipelineHooks(typing.Protocol):
    """What a pipeline runtime tells a stage's checkpointing, in the order it happens."""

    def begin_iteration(self, iteration: int) -> None:
        """Iteration ``iteration`` starts."""

    def no_bubble(self, position: int) -> None:
        """The stage did not have to wait at schedule position ``position``."""

    def bubble(self, position: int, receive, arrived=None):
        """The stage waits at ``position``: may use the wait, then returns ``receive()``'s
        value. ``receive()`` blocks until the neighbour's tensor is there and
        returns (value, arrival time on the perf_counter clock); ``arrived()``,
        if given, says without blocking whether it is there."""

    def end_iteration(self, iteration: int, state) -> None:
        """Step ``iteration`` finished with ``state`` (which must not be donated later)."""

    def flush(self) -> None:
        """Finishes the work held for later (training waits for it)."""

    def close(self) -> None:
        """Finishes and lets go of what the hooks hold."""


class NoSnapshots:
    """Hooks that do nothing: a bubble is only the wait. The baseline, and what a
    replaying stage runs with."""

    def begin_iteration(self, iteration: int) -> None:
        pass

    def no_bubble(self, position: int) -> None:
        pass

    def bubble(self, position: int, receive, arrived=None):
        return receive()[0]

    def end_iteration(self, iteration: int, state) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class LoggedSteps:
    """Wraps ``hooks`` so that no step counts as done before its log records are held.

    As an iteration begins, ``record(iteration)`` (if given) is sent to the
    training log of ``client`` (a DaemonClient), where the daemons store it
    while the step computes; as it ends, ``client.wait_log()`` waits for
    every record sent since (that one and the boundary records the stage
    logged), before ``hooks`` hear of the end. A rank that logs no record of
    its own (another rank logs the job's data order) passes ``record=None``
    and still waits for its boundary records. :class:`LogError` from the
    wait propagates: a step whose record was not stored cannot be replayed.

    Attributes:
      hooks: the wrapped hooks.
      copies: what the last ``wait_log`` returned (the fewest daemons holding
        one of the step's training-log records; 0 when none was pending).
    """

    def __init__(self, client, record=None, hooks: PipelineHooks | None = None):
        self.client, self._record = client, record
        self.hooks = NoSnapshots() if hooks is None else hooks
        self.copies = 0

    def begin_iteration(self, iteration: int) -> None:
        if self._record is not None:
            self.client.log(iteration, self._record(iteration))
        self.hooks.begin_iteration(iteration)

    def no_bubble(self, position: int) -> None:
        self.hooks.no_bubble(position)

    def bubble(self, position: int, receive, arrived=None):
        return self.hooks.bubble(position, receive, arrived)

    def end_iteration(self, iteration: int, state) -> None:
        self.copies = self.client.wait_log()
        self.hooks.end_iteration(iteration, state)

    def flush(self) -> None:
        self.hooks.flush()

    def close(self) -> None:
        """Closes the wrapped hooks (the client is the caller's to close)."""
        self.hooks.close()
