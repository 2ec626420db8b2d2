"""Loops as public JAX projects write them for Orbax (tests/programs/orbax_loops.py) run
with bubblesnap's manager: the import swapped, or nothing changed at all (the
``BUBBLESNAP_ORBAX`` switch); each SIGKILLed mid-run and resumed, then compared with
the same loops run by Orbax alone, bit for bit (state, resumed step, ``all_steps``,
metadata); two of them in two processes under jax.distributed. And a run that
switches mid-way: Orbax's steps resumed by bubblesnap's manager, bubblesnap's
steps resumed by plain Orbax.

The loops' folders lie inside the daemon's ``--durable-dir``: the daemon writes the steps
their policies keep, and restores come from its memory.
"""

import os

import pytest

from bubblesnap.run import orbax_patch
from bubblesnap.testing.multihost import JaxJob
from tests.helpers import ROOT

LOOPS = str(ROOT / "tests" / "programs" / "orbax_loops.py") + ":train"
ALL = ["flax_train_state", "flax_pytree", "composite_json", "framework_manager", "nnx_state",
       "keep_three"]
TWO = ["flax_train_state", "composite_json"]
STEPS, KILL_AT = 7, 3
#: The step each loop resumes from after the kill (the framework saves every other step).
RESUMED = {name: 2 if name == "framework_manager" else KILL_AT for name in ALL}


def run(processes: int, args: dict, env: dict | None = None, kill: bool = False):
    job = JaxJob(LOOPS, processes, {"steps": STEPS, "kill_at": KILL_AT, "kill": kill, **args},
                 env=env, timeout=300)
    if not kill:
        return job.results()
    assert job.wait_crash() == [-9] * processes
    return None


def switched_on(address: str) -> dict:
    """The environment of a process whose unchanged code gets bubblesnap's manager."""
    path = os.pathsep.join(filter(None, [orbax_patch.bootstrap_path(),
                                         os.environ.get("PYTHONPATH")]))
    return {"BUBBLESNAP_DAEMON": address, orbax_patch.ENV: "1", "PYTHONPATH": path}


def without_resume(results: list[dict]) -> list[dict]:
    return [{name: {k: v for k, v in loop.items() if k != "resumed_from"}
             for name, loop in result.items()} for result in results]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The two-process loops run by Orbax without a kill."""
    root = tmp_path_factory.mktemp("reference")
    return run(2, {"manager": "orbax", "loops": TWO, "root": str(root)})


@pytest.fixture(scope="module")
def resumed_orbax(tmp_path_factory):
    """The loops under Orbax, SIGKILLed and resumed: the loops' own behaviour. (Each
    loop's state is a function of its step alone, so this is also what a run without a
    kill ends with; tests/test_checkpoint_manager.py checks that of the README loop.)"""
    orbax = {"manager": "orbax", "loops": ALL, "root": str(tmp_path_factory.mktemp("orbax"))}
    run(1, orbax, kill=True)
    resumed = run(1, orbax)
    assert {n: loop["resumed_from"] for n, loop in resumed[0].items()} == RESUMED
    return resumed


def test_the_loops_users_have_resume_bit_for_bit_as_with_orbax(resumed_orbax, module_daemon,
                                                               module_durable):
    swapped = {"manager": "bubblesnap", "loops": ALL, "root": str(module_durable), "prefix": "s-"}
    env = {"BUBBLESNAP_DAEMON": module_daemon.address}
    run(1, swapped, env, kill=True)
    assert run(1, swapped, env) == resumed_orbax


@pytest.mark.slow
def test_the_loops_unchanged_resume_bit_for_bit_as_with_orbax(resumed_orbax, module_daemon,
                                                              module_durable):
    """The same with nothing changed (the ``BUBBLESNAP_ORBAX`` switch). Only with --all:
    the switch gives the very class the swapped import does, and make test resumes
    unchanged loops in test_a_run_switches_mid_way_and_keeps_its_history."""
    unchanged = {"manager": "patched", "loops": ALL, "root": str(module_durable), "prefix": "u-"}
    run(1, unchanged, switched_on(module_daemon.address), kill=True)
    assert run(1, unchanged, switched_on(module_daemon.address)) == resumed_orbax


def test_two_processes_under_jax_distributed_resume_as_with_orbax(reference, module_daemon,
                                                                  module_durable):
    args = {"manager": "bubblesnap", "loops": TWO, "root": str(module_durable), "prefix": "d-"}
    env = {"BUBBLESNAP_DAEMON": module_daemon.address}
    run(2, args, env, kill=True)
    resumed = run(2, args, env)
    assert [{n: loop["resumed_from"] for n, loop in r.items()} for r in resumed] == \
        [{n: RESUMED[n] for n in TWO}] * 2
    assert without_resume(resumed) == without_resume(reference)


def test_a_run_switches_mid_way_and_keeps_its_history(resumed_orbax, module_daemon, module_durable):
    """Orbax's steps resumed, with nothing changed, by bubblesnap's manager in the same
    folder; then bubblesnap's steps (written by the daemon) resumed by plain Orbax."""
    env = {"BUBBLESNAP_DAEMON": module_daemon.address}
    orbax_first = {"manager": "orbax", "loops": ALL, "root": str(module_durable), "prefix": "o-"}
    run(1, orbax_first, kill=True)
    assert run(1, {**orbax_first, "manager": "patched"},
               switched_on(module_daemon.address)) == resumed_orbax

    ours_first = {"manager": "bubblesnap", "loops": ALL, "root": str(module_durable),
                  "prefix": "b-"}
    run(1, ours_first, env, kill=True)  # each loop's last save finished: on disk
    by_orbax = run(1, {**ours_first, "manager": "orbax"})
    for name, loop in by_orbax[0].items():
        assert loop["resumed_from"] is not None and loop["resumed_from"] <= KILL_AT, name
        assert loop["digest"] == resumed_orbax[0][name]["digest"], name
