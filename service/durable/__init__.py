"""The durable tier: some committed steps written as standard Orbax checkpoints.

``DurableOptions`` and the pure rules (policy.py), the files (format.py),
``DurableWriter`` (background writes, retention on disk) and
``DurableReader`` (whole steps, loading a rank into a layout).
"""

from bubblesnap.service.durable.policy import DurableOptions
from bubblesnap.service.durable.reader import DurableReader
from bubblesnap.service.durable.writer import DurableWriter

__all__ = ["DurableOptions", "DurableReader", "DurableWriter"]
