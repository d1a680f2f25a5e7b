"""Randomized fault schedules against the packaged units in the throw-away systemd of tests/systemd
(Issue 45 item 1): the seeded schedule (``schedule``), what runs inside the box to read the backend
and the process table in one go (``box_batch``), the invariant checker (``invariants``) and the
driver that streams sessions, injects the faults and checks after each (``run``)."""
