"""Shared machinery of the test suite; test modules import from here, never from each other.

- ``aio``: ``run(coro, timeout)``, the one way a synchronous test runs a coroutine (fresh loop, bounded).
- ``waiting``: ``wait_until(predicate, timeout)``, the one polling wait.
- ``paths``: ``REPO_ROOT`` and the dev venv's python.
- ``processes``: ``alive``, ``group_alive``, ``group_exists``, ``kill_group``, ``terminate``.
- ``kandev``: ``Kandev``, a driver of one Kandev home through the real CLI; ``db_row``/``db_rows``.
- ``sessions``: starting, resuming and restarting sessions of a ``Kandev`` home and reading them back.
- ``agentctl``: a real control server started from a launch file (``write_launch``, ``start_server``).
- ``streams``: collectors of process output (``TimedOutput``) and of control-server event streams.
- ``sandbox_attacks``: attempts made from inside an agent's sandbox and the check of their verdicts.
- ``postgres``: a throwaway PostgreSQL server; ``releases``/``debs``: the previous release and the
  Debian packages, built and cached; ``sdbox``: a throw-away systemd (tests/systemd/sdbox.sh).
"""
