"""The environment ``python -m bubblesnap.run`` hands the programs it runs (and they hand
the processes they start): read by the Orbax patch and by the clients, which never
import the launcher."""

#: The switch Python's start-up reads (bubblesnap/run/bootstrap/sitecustomize.py): "1"
#: puts bubblesnap's managers behind Orbax's.
ORBAX_SWITCH_ENV = "BUBBLESNAP_ORBAX"
#: Where bubblesnap's CheckpointManagerOptions read ``memory_interval_steps`` for a manager
#: built with Orbax's own options (what ``python -m bubblesnap.run
#: --memory-interval-steps`` sets).
MEMORY_INTERVAL_ENV = "BUBBLESNAP_MEMORY_INTERVAL_STEPS"
