"""After every daemon's memory is lost (a reboot: the daemon SIGKILLed, its /dev/shm wiped,
a fresh daemon on the same --durable-dir), a job's CheckpointManager lists the steps on
disk and restores the latest onto another process count, bit for bit; a step whose save
never finished is not among them; with nothing to restore it raises what Orbax raises.
With no daemon at all the same holds: Orbax reads the steps."""

import os
import shutil

from bubblesnap.testing import DaemonProcess
from bubblesnap.testing.multihost import JaxJob
from tests.helpers import ROOT

PROGRAM = str(ROOT / "tests" / "programs" / "orbax_loops.py")


def test_a_rebooted_host_resumes_from_disk_onto_another_process_count(tmp_path, shm_dirs):
    durable, shm = tmp_path / "durable", shm_dirs()
    flags = ("--durable-dir", str(durable), "--shm-dir", shm)
    directory = str(durable / "topo")
    with DaemonProcess(*flags) as daemon:
        env = {"BUBBLESNAP_DAEMON": daemon.address}
        [saved, _, _] = JaxJob(PROGRAM + ":save_steps", 3, {"directory": directory, "steps": 3},
                               env=env, timeout=240).results()
        daemon.kill()
    shutil.rmtree(shm)  # the host's memory is gone, as after a reboot
    os.makedirs(shm)
    # a save cut short (its step never finalized by Orbax) is not a step
    os.makedirs(os.path.join(directory, "4.orbax-checkpoint-tmp", "default", "ocdbt.process_0"))

    with DaemonProcess(*flags) as fresh:
        env = {"BUBBLESNAP_DAEMON": fresh.address}
        resumed = JaxJob(PROGRAM + ":resume_steps", 2, {"directory": directory}, env=env,
                         timeout=240).results()
        for result in resumed:
            assert result["latest"] == 3 and result["all_steps"] == [1, 2, 3]
            assert result["digest"] == saved["digests"]["3"]
            assert result["types"] == ["int", "float"]  # as Orbax restores them
        nothing = JaxJob(PROGRAM + ":resume_steps", 1, {"directory": str(durable / "none")},
                         env=env, timeout=240).results()
    assert nothing == [{"latest": None, "all_steps": [], "raised": "FileNotFoundError"}]


def test_with_no_daemon_at_all_the_steps_are_listed_and_read_by_orbax(tmp_path):
    durable = tmp_path / "durable"
    directory = str(durable / "away")
    with DaemonProcess("--durable-dir", str(durable)) as daemon:
        [saved] = JaxJob(PROGRAM + ":save_steps", 1, {"directory": directory, "steps": 2},
                         env={"BUBBLESNAP_DAEMON": daemon.address}, timeout=240).results()
    gone = {"BUBBLESNAP_DAEMON": f"unix://{tmp_path}/no-daemon.sock"}
    [resumed] = JaxJob(PROGRAM + ":resume_steps", 1, {"directory": directory}, env=gone,
                       timeout=240).results()
    assert resumed["latest"] == 2 and resumed["all_steps"] == [1, 2]
    assert resumed["digest"] == saved["digests"]["2"]
    assert resumed["types"] == ["int", "float"]
