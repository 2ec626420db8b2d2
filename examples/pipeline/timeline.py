"""The timeline picture: one lane per stage, what it computed, where it waited, what it copied."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

STYLE = {  # label -> (colour, legend text, lane band: 0 full height, 1 lower half)
    "F": ("#4C72B0", "forward", 0),
    "B": ("#55A868", "backward", 0),
    "U": ("#8172B2", "optimizer update", 0),
    "hook": ("#937860", "snapshot hook at the step end", 0),
    "wait": ("#E5E5E5", "bubble (waiting for a neighbour)", 0),
    "chunk": ("#C44E52", "snapshot chunk fetched in a bubble", 1),
    "spill": ("#000000", "snapshot bytes spilled (training waited)", 1),
    "orbax": ("#DD8452", "Orbax save call", 1),
}


def draw(stages: list[dict], window: tuple[float, float], path: str, title: str) -> None:
    """``stages[i]`` has "events" and "spans": lists of (label, start, stop) in seconds."""
    t0, t1 = window
    fig, ax = plt.subplots(figsize=(13, 1.6 + 0.8 * len(stages)))
    for lane, stage in enumerate(stages):
        y = len(stages) - 1 - lane
        for label, start, stop in stage["events"] + stage["spans"]:
            if stop < t0 or start > t1:
                continue
            colour, _, band = STYLE[label]
            height, base = (0.8, y - 0.4) if band == 0 else (0.35, y - 0.4)
            ax.broken_barh([((max(start, t0) - t0) * 1e3, (min(stop, t1) - max(start, t0)) * 1e3)],
                           (base, height), facecolors=colour,
                           edgecolor="white" if band == 0 else colour, linewidth=0.3)
    ax.set_yticks(range(len(stages)), [f"stage {len(stages) - 1 - i}" for i in range(len(stages))])
    ax.set_xlabel("milliseconds")
    ax.set_xlim(0, (t1 - t0) * 1e3)
    ax.set_title(title)
    used = {label for s in stages for label, *_ in s["events"] + s["spans"]}
    fig.legend(handles=[Patch(color=c, label=text) for label, (c, text, _) in STYLE.items()
                        if label in used], loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12 if len(stages) > 2 else 0.2, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
