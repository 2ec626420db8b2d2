"""bubblesnap: checkpoints for pipeline-parallel JAX training, taken in pipeline bubbles.

Packages: ``bubblesnap.service`` (the daemon), ``bubblesnap.clients`` (libraries
used inside training), ``bubblesnap.protos`` (the wire contract).
"""

__version__ = "0.1.0"
