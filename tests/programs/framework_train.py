"""A training script of a framework that builds Orbax's manager inside its own code: it is
run unchanged, ``python framework_train.py DIR STEPS [KILL_AT]``, or under
``python -m bubblesnap.run``. It prints which manager it got, resumes from the latest step,
saves every step and prints one JSON line: where it resumed, its final value, the steps
kept. With KILL_AT it SIGKILLs itself after that step's save finished."""

import json
import os
import signal
import sys

import jax.numpy as jnp
import orbax.checkpoint as ocp


class Trainer:
    """The framework's side: the user never sees the manager."""

    def __init__(self, directory: str):
        self.manager = ocp.CheckpointManager(
            directory, item_handlers={"model": ocp.StandardCheckpointHandler(),
                                      "progress": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

    def fit(self, steps: int, kill_at: int | None) -> dict:
        model, latest = {"w": jnp.zeros((4,)), "n": 0}, self.manager.latest_step()
        if latest is not None:
            restored = self.manager.restore(latest, args=ocp.args.Composite(
                model=ocp.args.StandardRestore(model), progress=ocp.args.JsonRestore()))
            model = restored.model
        for step in range(0 if latest is None else latest + 1, steps):
            model = {"w": model["w"] + step, "n": model["n"] + 1}
            self.manager.save(step, args=ocp.args.Composite(
                model=ocp.args.StandardSave(model), progress=ocp.args.JsonSave({"step": step})))
            if step == kill_at:
                self.manager.wait_until_finished()
                os.kill(os.getpid(), signal.SIGKILL)
        self.manager.wait_until_finished()
        return {"resumed_from": latest, "w": model["w"].tolist(), "n": model["n"],
                "all_steps": list(self.manager.all_steps())}


if __name__ == "__main__":
    print("manager:", ocp.CheckpointManager.__module__, flush=True)
    kill = int(sys.argv[3]) if len(sys.argv) > 3 else None
    print(json.dumps(Trainer(sys.argv[1]).fit(int(sys.argv[2]), kill)), flush=True)
