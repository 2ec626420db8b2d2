"""What the daemon and the clients both use, and neither owns: where trainers reach their
daemon and the trainer token (trainer_api.py), the environment the launcher hands the
programs it runs (launch_env.py), the record a CheckpointManager item carries beside its
arrays (checkpoint_record.py, pure), the daemon's heartbeat file (heartbeat_file.py),
pages faulted in ahead (page_faults.py), byte sizes in flags and status lines
(sizes.py), exact reads for framed sockets (sockets.py) and the one check options
dataclasses run (options.py)."""
