"""pytest plugin: Orbax's own test files run unchanged against bubblesnap's manager.

Loaded by ``tests/conformance/orbax_manager.py`` (``-p tests.conformance.orbax_plugin``),
configured by the environment it sets:

- ``BUBBLESNAP_CONFORMANCE_ORBAX_SRC``: the ``orbax/checkpoint`` folder of an Orbax
  source tree; the test-only modules the installed wheel lacks
  (``_src/testing/multiprocess_test.py``) are found there.
- ``BUBBLESNAP_CONFORMANCE_TARGET``: ``bubblesnap`` binds
  ``orbax.checkpoint.checkpoint_manager.CheckpointManager`` and
  ``CheckpointManagerOptions`` to bubblesnap's, and Orbax v1's
  ``training.Checkpointer`` to bubblesnap's (bubblesnap.clients.jax.training), before
  the test file is imported (the import swap the README describes) and starts a daemon
  per test, at its defaults, with the test's temp folder as ``--durable-dir``;
  ``orbax`` runs plain Orbax. Orbax's emergency ``CheckpointManager`` is bound to
  bubblesnap's (bubblesnap.clients.jax.emergency) too.
- ``BUBBLESNAP_CONFORMANCE_PROCESS``: ``i/n@host:port``: this is process ``i`` of a job
  of ``n`` joined by ``jax.distributed`` at that coordinator, its daemon at
  ``$BUBBLESNAP_DAEMON`` (one of a ring the runner started for the whole run) instead
  of one per test.
- ``BUBBLESNAP_CONFORMANCE_REPORT``: a JSON lines file each test's outcome is appended to,
  with how its pytree items went: saved through the daemon or by Orbax itself,
  restored from the daemons' memory or read by Orbax.
"""

import json
import os
import time

import pytest

TARGET = os.environ.get("BUBBLESNAP_CONFORMANCE_TARGET", "bubblesnap")
REPORT = os.environ.get("BUBBLESNAP_CONFORMANCE_REPORT", "")
#: This test's pytree items: saved through a daemon / by Orbax, restored from memory / by Orbax.
COUNTS = {"daemon_saves": 0, "orbax_saves": 0, "memory_restores": 0, "orbax_restores": 0}


def pytest_configure(config):
    import jax
    import orbax.checkpoint._src.testing as testing

    from bubblesnap.testing import free_port

    # Orbax's multi-process test base waits at a barrier of JAX's distributed client: a
    # job of one process, or process i of n ("i/n@coordinator"), as Orbax's own runner
    # starts them (run_multihost.py).
    process = os.environ.get("BUBBLESNAP_CONFORMANCE_PROCESS")
    if process:
        index, rest = process.split("/", 1)
        count, coordinator = rest.split("@", 1)
        jax.distributed.initialize(coordinator, int(count), int(index))
    else:
        jax.distributed.initialize(f"127.0.0.1:{free_port()}", 1, 0)
    from absl import flags
    flags.FLAGS(["pytest"], known_only=True)  # absltest reads --test_tmpdir ($TEST_TMPDIR)

    source = os.environ.get("BUBBLESNAP_CONFORMANCE_ORBAX_SRC")
    extra = os.path.join(source, "_src", "testing") if source else None
    if extra and extra not in list(testing.__path__):
        testing.__path__.append(extra)  # a namespace package: the source's modules after
    if TARGET == "bubblesnap":
        from orbax.checkpoint import checkpoint_manager
        from orbax.checkpoint.experimental.emergency import (
            checkpoint_manager as orbax_emergency,
        )
        from orbax.checkpoint.experimental.v1 import training as orbax_training

        from bubblesnap.clients.jax import (
            CheckpointManager,
            CheckpointManagerOptions,
            emergency,
            training,
        )
        checkpoint_manager.CheckpointManager = CheckpointManager
        checkpoint_manager.CheckpointManagerOptions = CheckpointManagerOptions
        orbax_training.Checkpointer = training.Checkpointer
        orbax_emergency.CheckpointManager = emergency.CheckpointManager
        _count_tiers()


def _count_tiers() -> None:
    """Counts, per test, which of bubblesnap's paths each pytree item took."""
    from bubblesnap.clients.jax.tier.memory_tier import MemoryTier

    save, restore = MemoryTier.save_item, MemoryTier.restore_item

    def counted_save(self, *args, **kwargs):
        futures = save(self, *args, **kwargs)
        COUNTS["daemon_saves" if futures else "orbax_saves"] += 1
        return futures

    def counted_restore(self, *args, **kwargs):
        found = restore(self, *args, **kwargs)
        COUNTS["memory_restores" if found is not None else "orbax_restores"] += 1
        return found
    MemoryTier.save_item, MemoryTier.restore_item = counted_save, counted_restore


@pytest.fixture(autouse=True)
def _daemon_per_test(request):
    """A daemon for this test, its durable tier the test's temp folder (absltest's
    ``<TEST_TMPDIR>/<class>/<test method>``), reached through $BUBBLESNAP_DAEMON."""
    COUNTS.update(dict.fromkeys(COUNTS, 0))
    if TARGET != "bubblesnap" or os.environ.get("BUBBLESNAP_CONFORMANCE_PROCESS"):
        # a multi-process run: each process's daemon of a ring the runner started
        yield
        return
    from bubblesnap.testing import DaemonProcess

    folder = os.path.join(os.environ["TEST_TMPDIR"], request.cls.__qualname__,
                          request.node.name)
    os.makedirs(folder, exist_ok=True)
    log = os.path.join(os.environ["TEST_TMPDIR"], f"daemon-{request.node.name}.log")
    flags = os.environ.get("BUBBLESNAP_CONFORMANCE_DAEMON_FLAGS", "").split()
    with DaemonProcess("--durable-dir", folder, *flags, stderr=log, log_level="INFO") as daemon:
        os.environ["BUBBLESNAP_DAEMON"] = daemon.address
        try:
            yield
        finally:
            os.environ.pop("BUBBLESNAP_DAEMON", None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if REPORT and (report.when == "call" or report.outcome != "passed"):
        entry = {"test": item.name, "when": report.when, "outcome": report.outcome,
                 "seconds": round(report.duration, 3), "time": time.time(), **COUNTS}
        if report.outcome == "failed":
            entry["error"] = str(report.longrepr)[-6000:]
        with open(REPORT, "a") as f:
            f.write(json.dumps(entry) + "\n")
    return report
