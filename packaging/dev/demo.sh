#!/usr/bin/env bash
# The demo: both daemons on SQLite with the mock agent, a /slow turn, the backend SIGKILLed and
# restarted while the agent keeps streaming. Arguments go to `python -m daemon.cli.demo`.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
VENV=$(bash "$HERE/setup.sh" | tail -n 1)
exec "$VENV/bin/python" -m daemon.cli.demo "$@"
