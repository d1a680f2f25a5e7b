"""kandev daemons: the backend (``kandev-backend``) and the control server (``kandev-agentctl``).

Shared foundations live next to this file: ``paths`` (the Kandev home layout
and secret files), ``config`` (the TOML/env settings and their validation),
``platform`` (whether agent survival can work here), ``journal`` (structured
logging) and ``store`` (the backend's database).
"""
