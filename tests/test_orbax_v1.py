"""Orbax v1's ``training.Checkpointer`` loop (tests/programs/orbax_v1_loop.py) with
bubblesnap's: the import swapped, and nothing changed under bubblesnap's switch; each
SIGKILLed after a checkpoint and resumed from the daemon's memory, compared with the same
loop run by Orbax alone, bit for bit (state, the iterator's position, the steps kept);
in one process and in two under jax.distributed.

The loop's folder lies inside the daemon's ``--durable-dir``: the daemon writes the
pytree of every step the policy saves, Orbax v1 finalizes it, and the iterator is saved
by its own code.
"""

import pytest

from bubblesnap.testing.multihost import JaxJob
from tests.helpers import ROOT
from tests.test_orbax_loops import switched_on

LOOP = str(ROOT / "tests" / "programs" / "orbax_v1_loop.py") + ":train"
STEPS, KILL_AT, EVERY = 8, 4, 2


def run(processes: int, args: dict, env: dict | None = None, kill: bool = False):
    job = JaxJob(LOOP, processes, {"steps": STEPS, "kill_at": KILL_AT, "every": EVERY,
                                   "kill": kill, **args}, env=env, timeout=300)
    if not kill:
        return job.results()
    assert job.wait_crash() == [-9] * processes
    return None


def killed_and_resumed(processes: int, args: dict, env: dict | None = None):
    run(processes, args, env, kill=True)
    return run(processes, args, env)


def same_run(results: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("memory_loads", "resumed_from")}
            for r in results]


@pytest.fixture(scope="module")
def by_orbax(tmp_path_factory):
    """The loop under Orbax v1, not killed (its state, iterator and kept steps are a
    function of the step: what a run resumed from KILL_AT ends with)."""
    ran = run(1, {"checkpointer": "orbax", "directory": str(
        tmp_path_factory.mktemp("orbax") / "run")})
    assert ran[0]["resumed_from"] is None and ran[0]["step"] == STEPS
    return ran


# the unchanged loop in one process only with --all: make test runs it in two
@pytest.mark.parametrize("checkpointer", ["bubblesnap",
                                     pytest.param("patched", marks=pytest.mark.slow)])
def test_a_v1_loop_resumes_from_memory_bit_for_bit_as_with_orbax(by_orbax, module_daemon,
                                                                 module_durable, checkpointer):
    env = {"BUBBLESNAP_DAEMON": module_daemon.address}
    if checkpointer == "patched":
        env = switched_on(module_daemon.address)
    resumed = killed_and_resumed(1, {"checkpointer": checkpointer,
                                     "directory": str(module_durable / checkpointer)}, env)
    assert resumed[0]["resumed_from"] == KILL_AT  # its last checkpoint (EVERY divides it)
    assert resumed[0]["memory_loads"] == 1  # the state, from the daemon's memory
    assert same_run(resumed) == same_run(by_orbax)


def test_two_processes_under_jax_distributed_resume_as_with_orbax(tmp_path, module_daemon,
                                                                  module_durable):
    """Two processes of the unchanged loop under bubblesnap's switch, against Orbax's
    two-process run."""
    reference = run(2, {"checkpointer": "orbax", "directory": str(tmp_path / "orbax")})
    resumed = killed_and_resumed(2, {"checkpointer": "patched",
                                     "directory": str(module_durable / "two")},
                                 switched_on(module_daemon.address))
    assert [r["memory_loads"] for r in resumed] == [1, 1]
    assert [r["resumed_from"] for r in resumed] == [KILL_AT] * 2
    assert [{k: r[k] for k in ("digest", "position", "kept", "step")} for r in resumed] == \
        [{k: r[k] for k in ("digest", "position", "kept", "step")} for r in reference]
