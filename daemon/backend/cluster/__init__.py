"""Several hosts on one PostgreSQL (Issue 47, docs/cluster.md): who this backend is in the cluster
(``identity``), the cluster's hosts, their claims, heartbeats and reachability (``membership``).

A host's sessions are driven only by that host's backend; every other host reads them from the
shared store and shows them with their host's reachability."""
