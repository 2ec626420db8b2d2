"""A deterministic simulation of the group protocol's decisions (FoundationDB-style).

Daemons of a static ring, their trainers and the network between them are
modelled on one virtual clock (:mod:`.engine`); what each daemon decides is
the real pure code: ``group_view`` (committed, restorable and roundest steps,
re-replication, the committed steps a daemon keeps) and ``retention`` (what
it frees). Seeded faults (delays, reorderings, dropped requests and answers,
killed and restarted daemons, lost hosts, failed jobs that resume from a
restore and roll back) come from one ``random.Random``; the contract is
checked after every event (:mod:`.group`). A seed replays one history exactly.
"""
