"""Pipeline schedules: the ordered actions of each stage in one iteration.

An action is ("F", microbatch) or ("B", microbatch). The bubbles are not
listed: they are wherever a stage must wait for a neighbour's tensor.
"""


def gpipe(stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """All forwards, then all backwards (last microbatch first)."""
    del stages, stage
    return ([("F", m) for m in range(microbatches)]
            + [("B", m) for m in reversed(range(microbatches))])


def one_f_one_b(stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """PipeDream-flush 1F1B: a warm-up of forwards, then alternate, then drain backwards."""
    warmup = min(stages - 1 - stage, microbatches)
    actions = [("F", m) for m in range(warmup)]
    forward, backward = warmup, 0
    while forward < microbatches:
        actions.append(("F", forward))
        forward += 1
        actions.append(("B", backward))
        backward += 1
    actions += [("B", m) for m in range(backward, microbatches)]
    return actions


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}
