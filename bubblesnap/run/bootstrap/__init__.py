"""A folder Python adds to sys.path for its sitecustomize module (see sitecustomize.py)."""
