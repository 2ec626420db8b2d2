"""Where a daemon group learns who is in it and what it holds: the etcd backend
(``--coordination etcd://...``); the static ``--peers`` ring needs none of this."""
