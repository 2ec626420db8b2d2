"""Orbax's emergency CheckpointManager loop (tests/programs/orbax_emergency_loop.py)
with bubblesnap's: the import swapped, and nothing changed under bubblesnap's switch;
SIGKILLed and resumed, compared with the same loop under Orbax's own emergency manager,
bit for bit. With one slice Orbax's manager has no local tier and would resume from the
last persistent step; bubblesnap's holds every local-period step in the daemon's memory
and resumes from the newest. Also two jax.distributed processes, resumed by two and by
one (the state the two had, restored bit for bit); and a host lost with its memory: the
job resumes from the neighbour's copy.
"""

import os

import pytest

from bubblesnap.testing.multihost import JaxJob
from tests.helpers import ROOT
from tests.test_manager_jobs import wait_held
from tests.test_orbax_loops import switched_on

LOOP = str(ROOT / "tests" / "programs" / "orbax_emergency_loop.py") + ":train"
STEPS, KILL_AT, LOCAL, PERSISTENT = 9, 6, 2, 4


def run(processes: int, args: dict, env: dict | None = None, kill: bool = False):
    job = JaxJob(LOOP, processes, {"steps": STEPS, "kill_at": KILL_AT, "local": LOCAL,
                                   "persistent": PERSISTENT, "kill": kill, **args},
                 env=env, timeout=300)
    if not kill:
        return job.results()
    assert job.wait_crash() == [-9] * processes
    return None


def final(results: list[dict]) -> list[tuple]:
    return [(r["digest"], r["step"]) for r in results]


@pytest.fixture(scope="module")
def by_orbax(tmp_path_factory):
    """The loop under Orbax's emergency manager, not killed (with one slice Orbax's
    would resume from the last persistent step: the state is a function of the step)."""
    ran = run(1, {"manager": "orbax", "root": str(tmp_path_factory.mktemp("orbax"))})
    assert ran[0]["resumed_from"] is None and ran[0]["step"] == STEPS
    return ran


# the unchanged loop in one process only with --all: make test runs it in two
@pytest.mark.parametrize("manager", ["bubblesnap",
                                     pytest.param("patched", marks=pytest.mark.slow)])
def test_the_emergency_loop_resumes_from_memory_bit_for_bit(by_orbax, module_daemon, module_durable,
                                                             manager):
    env = switched_on(module_daemon.address) if manager == "patched" else \
        {"BUBBLESNAP_DAEMON": module_daemon.address}
    args = {"manager": manager, "root": str(module_durable / manager)}
    run(1, args, env, kill=True)
    resumed = run(1, args, env)
    assert resumed[0]["resumed_from"] == KILL_AT  # the local step, from memory
    assert final(resumed) == final(by_orbax)
    assert set(by_orbax[0]["all_steps"]) <= set(resumed[0]["all_steps"])


def test_two_processes_resume_by_two_and_by_one(module_daemon, module_durable):
    """Two processes of the unchanged loop under bubblesnap's switch, SIGKILLed after step
    KILL_AT and resumed by two and by one: the state restored is the one the two had,
    bit for bit (the rest of the run is the same computation as the one-process tests')."""
    env = switched_on(module_daemon.address)
    for resumed_by in (2, 1):
        root = module_durable / f"two-{resumed_by}"
        run(2, {"manager": "patched", "root": str(root)}, env, kill=True)
        resumed = run(resumed_by, {"manager": "patched", "root": str(root)}, env)
        assert [r["resumed_from"] for r in resumed] == [KILL_AT] * resumed_by
        killed = (root / "killed.digest").read_text()
        assert [r["restored"] for r in resumed] == [killed] * resumed_by
        assert [r["step"] for r in resumed] == [STEPS] * resumed_by


def test_a_host_lost_with_its_memory_resumes_from_the_neighbour(by_orbax, start_ring,
                                                                tmp_path):
    """The trainer's daemon SIGKILLed (its memory gone with it) after the local step was
    replicated: the job, moved to the other host, resumes from the neighbour's copy of
    the local step, not from the older persistent one."""
    ring = start_ring(2, "--replicas", "1", "--durable-dir", str(tmp_path))
    lost, neighbour = ring.daemons
    args = {"manager": "bubblesnap", "root": str(tmp_path / "run")}
    run(1, args, {"BUBBLESNAP_DAEMON": lost.address}, kill=True)
    job = f"{os.path.realpath(tmp_path / 'run' / 'persistent')}/state"
    wait_held(neighbour, job, KILL_AT)
    lost.kill()
    resumed = run(1, args, {"BUBBLESNAP_DAEMON": neighbour.address})
    assert resumed[0]["resumed_from"] == KILL_AT
    assert resumed[0]["restored"] == (tmp_path / "run" / "killed.digest").read_text()
    assert final(resumed) == final(by_orbax)
