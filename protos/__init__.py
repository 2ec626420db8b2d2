"""The wire contract: generated gRPC stubs and the checksum the contract names.

Regenerate the stubs with ``python protos/generate.py``.
"""
