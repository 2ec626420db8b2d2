"""Where the bootstrap folder was: it moved to bubblesnap/run/bootstrap/ (what ``python -m
bubblesnap.run --pythonpath`` prints). A PYTHONPATH that still names this folder keeps
working: its sitecustomize.py says so and runs the moved one."""
