"""One virtual clock, the events on it, coroutines that block on it, and a lossy network.

A coroutine is a generator that yields what it waits for: ``Sleep(seconds)``,
``Call(...)`` (answered with ``("ok", answer)`` or ``("error", code)``),
``Gather([...calls])`` (a list of those, the calls made at once) or
``Wait(seconds)`` (until :meth:`Sim.notify` wakes the host or the time is up).
It runs on behalf of a host's incarnation: once the host dies, it never resumes.
A host answers a call with ``handle(source, method, payload)``: (the seconds its
work takes, a function run then that makes the answer), nothing happening if it
dies meanwhile.
"""

import dataclasses
import heapq
import random
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclasses.dataclass(frozen=True)
class Call:
    target: int
    method: str
    payload: object = None
    timeout: float = 2.0
    reliable: bool = False  # neither the request nor the answer is lost


@dataclasses.dataclass(frozen=True)
class Gather:
    calls: tuple


@dataclasses.dataclass(frozen=True)
class Wait:
    seconds: float


@dataclasses.dataclass
class Faults:
    """What the network and the hosts do wrong, as probabilities and delays (seconds)."""

    delay: tuple[float, float] = (0.0005, 0.05)   # one way, uniform
    slow: float = 0.02                            # a message held back up to slow_delay
    slow_delay: float = 1.5
    drop: float = 0.01                            # a request or an answer lost


class Sim:
    """The clock and its events; ``run`` executes them in time order (ties: in order of
    scheduling), calling ``after_event`` after each one."""

    def __init__(self, seed: int, faults: Faults):
        self.rng = random.Random(seed)
        self.faults = faults
        self.now = 0.0
        self.events = 0
        self._queue: list = []
        self._seq = 0
        self.hosts: dict[int, object] = {}  # index -> the host object calls are handed to
        self._waiting: dict[int, tuple[int, Callable]] = {}  # index -> (incarnation, then)
        self.in_flight: dict[str, int] = {}  # method -> calls not answered yet

    def at(self, delay: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (self.now + max(0.0, delay), self._seq, action))

    def run(self, max_events: int, after_event: Callable[[], None],
            until: Callable[[], bool] = lambda: False) -> None:
        while self._queue and self.events < max_events and not until():
            self.now, _, action = heapq.heappop(self._queue)
            action()
            self.events += 1
            after_event()

    # -- coroutines ---------------------------------------------------------------

    def spawn(self, host, generator) -> None:
        """Runs ``generator`` for ``host`` (an object with ``alive`` and ``incarnation``)."""
        incarnation = host.incarnation
        self._resume(host, incarnation, generator, None)

    def _resume(self, host, incarnation: int, generator, value) -> None:
        if not host.alive or host.incarnation != incarnation:
            return  # the host died: its threads are gone
        try:
            command = generator.send(value)
        except StopIteration:
            return

        def then(result):
            self._resume(host, incarnation, generator, result)
        if isinstance(command, Sleep):
            self.at(command.seconds, lambda: then(None))
        elif isinstance(command, Wait):
            self._wait(host, incarnation, command.seconds, then)
        elif isinstance(command, Call):
            self.call(host.index, command, then)
        elif isinstance(command, Gather):
            self._gather(host.index, command.calls, then)
        else:
            raise TypeError(f"a coroutine yielded {command!r}")

    def _wait(self, host, incarnation: int, seconds: float, then) -> None:
        token = (incarnation, then)
        self._waiting[host.index] = token

        def wake():
            if self._waiting.get(host.index) is token:
                del self._waiting[host.index]
                then(None)
        self.at(seconds, wake)
        host.wake = lambda: self.at(0.0005, wake)  # a woken thread runs a moment later

    def notify(self, host) -> None:
        """Wakes ``host``'s coroutine waiting in ``Wait``, if one is."""
        wake = getattr(host, "wake", None)
        if wake is not None and host.index in self._waiting:
            wake()

    def _gather(self, source: int, calls, then) -> None:
        results: list = [None] * len(calls)
        left = [len(calls)]
        if not calls:
            self.at(0.0, lambda: then([]))
            return

        def one(i):
            def done(result):
                results[i] = result
                left[0] -= 1
                if not left[0]:
                    then(results)
            return done
        for i, call in enumerate(calls):
            self.call(source, call, one(i))

    # -- the network -----------------------------------------------------------------

    def _delay(self) -> float:
        f = self.faults
        base = self.rng.uniform(*f.delay)
        return base + (self.rng.uniform(0, f.slow_delay) if self.rng.random() < f.slow else 0.0)

    def call(self, source: int, call: Call, then) -> None:
        """One RPC from host ``source``: the request travels, the target's handler runs
        when it arrives (it may take time: ``handle`` answers (answer, seconds)), the
        answer travels back. A dead target refuses at once; a lost request or answer,
        or one later than the deadline, is DEADLINE_EXCEEDED at the deadline."""
        answered = [False]
        sender = self.hosts[source]
        incarnation = sender.incarnation
        self.in_flight[call.method] = self.in_flight.get(call.method, 0) + 1
        lossy = 0.0 if call.reliable else self.faults.drop

        def finish(result):
            if answered[0]:
                return
            answered[0] = True
            self.in_flight[call.method] -= 1
            if sender.alive and sender.incarnation == incarnation:
                then(result)
        self.at(call.timeout, lambda: finish(("error", "DEADLINE_EXCEEDED")))
        target = self.hosts.get(call.target)
        if target is None or not target.alive:
            self.at(self._delay(), lambda: finish(("error", "UNAVAILABLE")))
            return
        if self.rng.random() < lossy:
            return  # the request is lost
        target_incarnation = target.incarnation

        def arrive():
            if not target.alive or target.incarnation != target_incarnation:
                finish(("error", "UNAVAILABLE"))
                return
            seconds, complete = target.handle(source, call.method, call.payload)
            self.at(seconds, lambda: reply(complete))

        def reply(complete):
            if not target.alive or target.incarnation != target_incarnation:
                finish(("error", "UNAVAILABLE"))  # it died while it worked on the call
                return
            answer = complete()
            if self.rng.random() < lossy:
                return  # the answer is lost
            self.at(self._delay(), lambda: finish(answer))
        self.at(self._delay(), arrive)
