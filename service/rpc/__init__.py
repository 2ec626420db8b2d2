"""The daemon's gRPC faces: servicers that translate and delegate, nothing else.

trainer.py (``bubblesnap.v1.Daemon``) and peer.py (``bubblesnap.v1.Peer``);
messages.py converts and validates what enters; status_codes.py maps errors
to codes; handlers.py parses requests so a malformed one is INVALID_ARGUMENT.
"""
