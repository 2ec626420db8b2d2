"""The durable tier: some committed steps, each one standard Orbax checkpoint of the job.

``DurableOptions`` and the pure rules (policy.py: which steps, when one is
whole, what to retire; orbax_layout.py: the checkpoint's tree and chunk grid;
sidecar.py: what a rank wrote), the files (format.py), the Orbax and
TensorStore calls (checkpoint.py), ``DurableWriter`` (background writes,
finalizing, retention) and ``DurableReader`` (finalized steps, verified
regions, loading a rank into a layout).
"""

from bubblesnap.service.durable.policy import DurableOptions
from bubblesnap.service.durable.reader import DurableReader, RankCopy
from bubblesnap.service.durable.writer import DurableWriter

__all__ = ["DurableOptions", "DurableReader", "DurableWriter", "RankCopy"]
