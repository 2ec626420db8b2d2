"""One ``jax.distributed`` job of N processes on this machine: tests, examples, benchmarks.

Each process stands for one host: it runs ``python -m bubblesnap.testing.multihost
FILE:FUNCTION ARGS``, joins the job with ``jax.distributed.initialize`` (a
coordinator on a free loopback port), sees ``devices`` forced CPU devices of
its own, calls ``FUNCTION(args)`` from FILE and writes the JSON of what it
returns to a file the parent reads. On the way it may print events (:func:`event`)
the parent waits for, e.g. to SIGKILL every process at a chosen moment::

    from bubblesnap.testing.multihost import JaxJob

    with JaxJob("tests/programs/multihost_cases.py:train", 2, {"daemon": address}) as job:
        job.wait_event(lambda e: e["event"] == "snapshotted" and e["step"] >= 3)
        job.kill()                                  # every process, SIGKILL
    results = JaxJob("...:resume", 1, args, devices=4).results()   # one per process

A program that stands for a crash at a point of its own calls :func:`crash` there, and
the parent ``JaxJob(...).wait_crash()``: every process SIGKILLed once all got there.
A process that exits without a result, or a job past its timeout, raises
:class:`JobError` with each process's exit status and the tail of its stderr.
"""

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from bubblesnap.testing.processes import free_port

_RESULT_FILE = "BUBBLESNAP_RESULT_FILE"
_EVENT = "BUBBLESNAP_EVENT "
_CRASH = "bubblesnap.testing.multihost.crash"


class JobError(RuntimeError):
    """A process of the job failed, or the job ran past its timeout."""


def event(**fields) -> None:
    """Prints one event (JSON-able fields) for the parent's :meth:`JaxJob.wait_event`."""
    _say(_EVENT, fields)


def crash() -> NoReturn:
    """Stands for this process crashing here: tells the parent and waits to be SIGKILLed
    (:meth:`JaxJob.wait_crash`), never returns.

    A process of a job that SIGKILLs itself can take the job's coordination service down
    (process 0 hosts it) while another process has not reached its own kill yet; that
    one then dies of the lost service (SIGABRT) instead, wherever it was.
    """
    _say(_EVENT, {"event": _CRASH})
    while True:
        signal.pause()


def _say(marker: str, value) -> None:
    # One write of the whole line: jax.distributed's C++ side prints to the same stdout
    # from its own threads, and print() makes two writes (text, newline) when Python's
    # output is unbuffered (as under pytest-xdist), so its words could land inside ours.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (marker + json.dumps(value) + "\n").encode())


def _parsed(line: str, marker: str):
    """The JSON after ``marker`` in ``line`` (other output may surround it), or None."""
    at = line.find(marker)
    if at < 0:
        return None
    return json.JSONDecoder().raw_decode(line, at + len(marker))[0]


class JaxJob:
    """``processes`` processes of one ``jax.distributed`` job, started at once.

    ``target`` is ``path/to/file.py:function``; ``function(args)`` runs in
    every process after ``jax.distributed.initialize`` and returns something
    JSON can write. ``env`` adds to each process's environment; ``devices``
    is the number of CPU devices each process has.
    """

    def __init__(self, target: str, processes: int, args: dict | None = None, *,
                 devices: int = 2, env: dict | None = None, timeout: float = 180.0):
        self.target, self.count, self.timeout = target, processes, timeout
        self._deadline = time.monotonic() + timeout
        self._events: queue.Queue = queue.Queue()
        # Each process writes its result into a file of its own: on stdout the C++ side
        # (Gloo's "connected to peer" lines) can land inside a line Python writes.
        self._results_dir = tempfile.TemporaryDirectory(prefix="bubblesnap-multihost-")
        self._stdout_tail: dict[int, list[str]] = {}
        # Appending: the child writes through the same file offset the parent reads with.
        self._stderr = [tempfile.TemporaryFile(mode="a+") for _ in range(processes)]
        coordinator = f"127.0.0.1:{free_port()}"
        # No persistent compilation cache shared with other jobs: in the suite, two 2-process
        # jobs started together (Orbax's own loops) hung with all four processes in the same
        # all-gather of Orbax's barrier (py-spy); a cache written by one job while another
        # runs can hand one process of a job an executable it did not compile while its
        # peer compiles its own. Not proven the cause; taken out of the suspects.
        base = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "false",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
                "BUBBLESNAP_COORDINATOR": coordinator,
                "BUBBLESNAP_PROCESSES": str(processes), **(env or {})}
        self.procs: list[subprocess.Popen] = []
        self._readers: list[threading.Thread] = []
        for index in range(processes):
            proc = subprocess.Popen(
                [sys.executable, "-m", "bubblesnap.testing.multihost", target,
                 json.dumps(args or {})],
                env={**base, "BUBBLESNAP_PROCESS": str(index),
                     _RESULT_FILE: self._result_path(index)}, stdout=subprocess.PIPE,
                stderr=self._stderr[index], text=True)
            self.procs.append(proc)
            reader = threading.Thread(target=self._read, args=(index, proc), daemon=True)
            reader.start()
            self._readers.append(reader)

    def _read(self, index: int, proc: subprocess.Popen) -> None:
        tail = self._stdout_tail.setdefault(index, [])
        for line in proc.stdout:
            if _EVENT in line:
                try:
                    self._events.put((index, _parsed(line, _EVENT)))
                    continue
                except ValueError:  # another writer's bytes inside the line
                    pass
            tail[:] = [*tail[-20:], line.rstrip()]

    def _result_path(self, index: int) -> str:
        return os.path.join(self._results_dir.name, f"result_{index}.json")

    def _result(self, index: int):
        """What process ``index`` returned; KeyError when it wrote nothing."""
        try:
            with open(self._result_path(index)) as f:
                return json.load(f)
        except (OSError, ValueError):
            raise KeyError(index) from None

    def __enter__(self) -> "JaxJob":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def wait_event(self, check: Callable[[dict], bool], timeout: float | None = None,
                   processes=None) -> list[dict]:
        """Waits until every process (of ``processes``, default all) printed an event
        ``check`` accepts; those events, in process order. JobError if one of them exits
        first or the time runs out."""
        deadline = self._deadline if timeout is None else time.monotonic() + timeout
        awaited = sorted(range(self.count) if processes is None else processes)
        found: dict[int, dict] = {}
        while len(found) < len(awaited):
            try:
                index, fields = self._events.get(timeout=0.1)
                if index in awaited and index not in found and check(fields):
                    found[index] = fields
                continue
            except queue.Empty:
                pass
            exited = [i for i in awaited if self.procs[i].poll() is not None
                      and i not in found]
            if exited and self._events.empty():
                self._fail(f"process {exited[0]} exited before the awaited event")
            if time.monotonic() > deadline:
                self._fail("timed out waiting for an event")
        return [found[i] for i in awaited]

    def watch(self, check: Callable[[int, dict], bool],
              seen: Callable[[int, dict], None] | None = None,
              timeout: float | None = None) -> tuple[int, dict]:
        """Reads every process's events in the order they came, handing each to ``seen``
        (if given), until ``check(process, fields)`` accepts one: that (process, fields).
        JobError if a process exits before (once its events are read) or the time runs
        out. (Not beside :meth:`wait_event`, which passes over what it does not await.)"""
        deadline = self._deadline if timeout is None else time.monotonic() + timeout
        while True:
            try:
                index, fields = self._events.get(timeout=0.1)
            except queue.Empty:
                exited = [i for i, p in enumerate(self.procs) if p.poll() is not None]
                if exited and self._events.empty():
                    self._fail(f"process {exited[0]} exited before the awaited event")
                if time.monotonic() > deadline:
                    self._fail("timed out waiting for an event")
                continue
            if seen is not None:
                seen(index, fields)
            if check(index, fields):
                return index, fields

    def events(self) -> list[tuple[int, dict]]:
        """The events read and not yet taken, as (process, fields), in the order they came
        (after :meth:`kill`: every one printed before it)."""
        found = []
        while True:
            try:
                found.append(self._events.get_nowait())
            except queue.Empty:
                return found

    def results(self) -> list:
        """Waits for every process to finish; what each one's function returned."""
        for index, proc in enumerate(self.procs):
            try:
                proc.wait(timeout=max(0.1, self._deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._fail(f"timed out after {self.timeout:.0f} s (process {index} still runs)")
            self._readers[index].join(timeout=10)
        results = {}
        for index in range(self.count):
            try:
                results[index] = self._result(index)
            except KeyError:
                pass
        failed = [i for i, p in enumerate(self.procs) if p.returncode != 0 or i not in results]
        if failed:
            self._fail(f"process {failed[0]} failed")
        return [results[i] for i in range(self.count)]

    def wait_crash(self, kill: bool = True, processes=None) -> list[int]:
        """Waits until every process called :func:`crash`, SIGKILLs them; their exit
        statuses (``-9`` each: a process's status is fixed once the signal is sent, so
        one killed after process 0 cannot die of the lost coordination service
        instead). JobError if a process exits before it got there. ``kill=False``
        returns once every process got there, leaving the kill to the caller (who may
        first do something else, say freeze a daemon): their statuses are None then.
        ``processes``: only those get there (the others may be stuck waiting for them, as
        a job's processes wait for a peer that died); every process is killed all the
        same."""
        self.wait_event(lambda e: e.get("event") == _CRASH, processes=processes)
        if kill:
            self.kill()
        return [proc.returncode for proc in self.procs]

    def kill(self) -> None:
        """SIGKILLs every process still running and reaps it; returns once what they
        printed before is read."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        for reader in self._readers:  # every event printed before the kill is queued
            reader.join(timeout=10)

    def stderr(self, index: int) -> str:
        """What process ``index`` wrote on stderr so far."""
        handle = self._stderr[index]
        handle.flush()
        handle.seek(0)
        return handle.read()

    def _fail(self, what: str):
        self.kill()
        report = []
        for index, proc in enumerate(self.procs):
            err = "\n".join(self.stderr(index).strip().splitlines()[-25:])
            out = "\n".join(self._stdout_tail.get(index, []))
            report.append(f"--- process {index} (exit {proc.returncode}) stdout tail:\n{out}\n"
                          f"--- process {index} stderr tail:\n{err}")
        raise JobError(f"{self.target} x {self.count}: {what}\n" + "\n".join(report))


def _load(target: str):
    path, _, name = target.rpartition(":")
    if not path or not name:
        raise SystemExit(f"target {target!r}: write path/to/file.py:function")
    # As if the file were run as a script: its folder first on the path.
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec = importlib.util.spec_from_file_location("_bubblesnap_multihost_target", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def _main(argv: list[str]) -> int:
    import jax  # only in the job's processes: the parent may hold other devices

    target, args = argv[0], json.loads(argv[1])
    jax.distributed.initialize(os.environ["BUBBLESNAP_COORDINATOR"],
                               int(os.environ["BUBBLESNAP_PROCESSES"]),
                               int(os.environ["BUBBLESNAP_PROCESS"]),
                               initialization_timeout=120)
    result = json.dumps(_load(target)(args))
    path = os.environ[_RESULT_FILE]
    with open(f"{path}.tmp", "w") as f:
        f.write(result)
    os.replace(f"{path}.tmp", path)  # whole or absent
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
