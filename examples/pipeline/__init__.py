"""A small pipeline-parallel GPT runtime for the bubblesnap examples and benchmarks.

model.py      the GPT decoder, split into stages, with per-stage forward/backward/update
schedules.py  GPipe and 1F1B action lists per stage
transport.py  how activations and gradients travel: threads, sockets, or a relay
relay.py      the relay: forwards tensors between stage processes, outlives any one
stage_recovery.py  one failed stage restores and replays from boundary logs (Swift;
                   the logs are bubblesnap.clients.BoundaryLog)
parallel_replay.py the replacement's lost steps replayed by several workers, a share
                   of the microbatches each (bubblesnap.clients.replay_shares)
coordinator.py     decides who replays what after a stage fails; runs beside the relay
data_loader.py     a shuffling loader whose position is logged and replayed
stage.py      one stage's loop: compute, wait (bubbles), snapshot hooks, timing
snapshot_modes.py  the ways a stage checkpoints, as pipeline hooks, to interleave them
timeline.py   the picture: one lane per stage, compute, bubbles, snapshot chunks
"""
