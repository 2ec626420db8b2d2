"""The example pipeline's replay workers (examples/pipeline/parallel_replay.py), in process on
the forced CPU devices: steps shared by two workers, each on its own device, end in the
state and send the tensors that the stage's own loop does, bit for bit."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from bubblesnap.clients import NoSnapshots
from bubblesnap.testing import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from pipeline import model
from pipeline.parallel_replay import ReplayWorkers
from pipeline.schedules import SCHEDULES
from pipeline.stage import StageRunner
from pipeline.transport import Inbox

STAGES, MICROBATCHES, STEPS = 3, 4, (5, 6)


def logged_inputs(config, stage: int) -> dict:
    """What the neighbours sent the stage in each step, as their boundary logs hold it."""
    rng = np.random.default_rng(stage)
    shape = (config.microbatch_size, config.seq_len, config.d_model)
    inputs = {}
    for step in STEPS:
        for mb in range(MICROBATCHES):
            if stage > 0:
                inputs[("act", step, mb)] = rng.standard_normal(shape, np.float32)
            if stage < STAGES - 1:
                inputs[("grad", step, mb)] = rng.standard_normal(shape, np.float32) * 1e-3
    return inputs


def digest(state) -> list[bytes]:
    return [np.asarray(jax.device_get(leaf)).tobytes() for leaf in jax.tree.leaves(state)]


@pytest.mark.parametrize("stage", range(STAGES))
def test_two_workers_replay_the_steps_the_stages_loop_computes(stage):
    config = model.GPTConfig(d_model=64, layers_per_stage=(1,), vocab=256)
    schedule = SCHEDULES["1f1b"](STAGES, MICROBATCHES, stage)
    inputs = logged_inputs(config, stage)
    devices = jax.devices()[:2]

    alone = model.StageProgram(config, STAGES, stage, devices[:1])
    inbox, sent_alone = Inbox(timeout=5), []
    for key, value in inputs.items():
        inbox.put(key, value)
    StageRunner(alone, schedule, stage, STAGES, inbox,
                lambda to, key, value: sent_alone.append((to, key, np.asarray(value))),
                {"m": NoSnapshots()}).run(["m"] * len(STEPS), first_iteration=STEPS[0])

    shared = model.StageProgram(config, STAGES, stage, devices[:1])
    workers = ReplayWorkers(shared, schedule, stage, STAGES,
                            lambda step, mb: model.batch(config, step, mb), devices)
    wait_for(lambda: None not in workers.warm_up_seconds, "both devices' compiles",
             timeout=300)
    sent_shared = []
    try:
        for step in STEPS:
            workers.replay(step, lambda key, sender: (inputs[key], 0.0),
                           lambda to, key, value: sent_shared.append((to, key, np.asarray(value))))
    finally:
        workers.close()

    assert workers.workers_by_step == [2, 2]
    assert digest(shared.state) == digest(alone.state)
    assert [(to, key) for to, key, _ in sent_shared] == [(to, key) for to, key, _ in sent_alone]
    assert all(a.tobytes() == b.tobytes()
               for (_, _, a), (_, _, b) in zip(sent_shared, sent_alone, strict=True))
