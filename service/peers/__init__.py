"""The peer group: ring and liveness (group), what it holds (group_view, pure), pushing
copies (replicator) and moving them (transfers, data_channel), peer auth (security),
training logs kept by peers (log_replication)."""
