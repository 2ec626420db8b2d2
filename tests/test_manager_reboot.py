"""After every daemon's memory is lost (a reboot: the daemon SIGKILLed, its /dev/shm wiped,
a fresh daemon on the same --durable-dir), a job's CheckpointManager lists the durable
tier's whole steps before any trainer registered, and restores the latest onto another
process count, bit for bit; with nothing to restore it raises what Orbax raises."""

import os
import shutil

from bubblesnap.checkpoint_record import PARTIAL_DIR
from bubblesnap.multihost import JaxJob
from bubblesnap.service.durable import DurableReader
from bubblesnap.testing import DaemonProcess, wait_for
from tests.helpers import ROOT

PROGRAM = str(ROOT / "tests" / "programs" / "orbax_loops.py")


def test_a_rebooted_host_resumes_from_the_durable_tier_onto_another_process_count(
        tmp_path, shm_dirs):
    durable, shm = tmp_path / "durable", shm_dirs()
    flags = ("--durable-dir", str(durable), "--durable-every-steps", "1", "--shm-dir", shm)
    directory = str(durable / "topo")
    daemon = DaemonProcess(*flags)
    try:
        env = {"BUBBLESNAP_DAEMON": daemon.address}
        [saved, _, _] = JaxJob(PROGRAM + ":save_steps", 3, {"directory": directory, "steps": 3},
                               env=env, timeout=240).results()
        reader = DurableReader(str(durable))
        wait_for(lambda: reader.steps("topo"), "a whole step in the durable tier")
    finally:
        daemon.kill()
    whole = reader.steps("topo")  # read after the kill: nothing is written any more
    shutil.rmtree(shm)  # the host's memory is gone, as after a reboot
    os.makedirs(shm)
    # a step the killed daemon was writing (its folder half made) never becomes whole
    os.makedirs(os.path.join(directory, PARTIAL_DIR, str(whole[-1] + 5), "ocdbt.process_0"))

    with DaemonProcess(*flags) as fresh:
        env = {"BUBBLESNAP_DAEMON": fresh.address}
        resumed = JaxJob(PROGRAM + ":resume_steps", 2, {"directory": directory}, env=env,
                         timeout=240).results()
        for result in resumed:
            assert result["latest"] == whole[-1] and result["all_steps"] == whole
            assert result["digest"] == saved["digests"][str(whole[-1])]
            assert result["types"] == ["int", "float"]  # as Orbax restores them
        nothing = JaxJob(PROGRAM + ":resume_steps", 1, {"directory": str(durable / "none")},
                         env=env, timeout=240).results()
    assert nothing == [{"latest": None, "all_steps": [], "raised": "FileNotFoundError"}]


def test_with_no_daemon_at_all_the_persisted_steps_are_listed_and_read_by_orbax(tmp_path):
    """A host whose daemon is down still resumes: the manager lists the folders the
    daemons wrote and Orbax reads the step (the record from its folder)."""
    durable = tmp_path / "durable"
    directory = str(durable / "away")
    with DaemonProcess("--durable-dir", str(durable), "--durable-every-steps", "1") as daemon:
        [saved] = JaxJob(PROGRAM + ":save_steps", 1, {"directory": directory, "steps": 2},
                         env={"BUBBLESNAP_DAEMON": daemon.address}, timeout=240).results()
        reader = DurableReader(str(durable))
        wait_for(lambda: reader.steps("away"), "a whole step in the durable tier")
    whole = reader.steps("away")
    gone = {"BUBBLESNAP_DAEMON": f"unix://{tmp_path}/no-daemon.sock"}
    [resumed] = JaxJob(PROGRAM + ":resume_steps", 1, {"directory": directory}, env=gone,
                       timeout=240).results()
    assert resumed["latest"] == whole[-1] and resumed["all_steps"] == whole
    assert resumed["digest"] == saved["digests"][str(whole[-1])]
    assert resumed["types"] == ["int", "float"]
