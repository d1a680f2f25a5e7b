"""The order in which the test modules are handed to the parallel workers: the longest first.

The suite runs one module per worker (``--dist loadfile``), in collection order
(``--no-loadscope-reorder``: pytest-xdist would otherwise start the modules with the most tests
first, and the few long ones, a 100-reload scenario or the package builds, would start last and
run on alone at the end). ``LONGEST_FIRST`` names the modules that took longest in a full run
(measured with ``--durations=0``; order only, no time is asserted), longest first; every other
module follows in its usual order. A name that no longer exists is reported by
tests/unit/test_test_schedule.py.
"""

from __future__ import annotations

LONGEST_FIRST = (
    "tests/systemd/test_chaos_systemd.py",
    "tests/integration/test_reload_random.py",
    "tests/systemd/test_package.py",
    "tests/integration/test_reload_cli.py",
    "tests/integration/test_agent_opencode.py",
    "tests/integration/test_ownership_backend.py",
    "tests/integration/test_resume.py",
    "tests/integration/test_runtimes_npm.py",
    "tests/integration/test_chaos_kills.py",
    "tests/integration/test_control_server_loss.py",
    "tests/integration/test_retracking.py",
    "tests/integration/test_recovery_faults.py",
    "tests/integration/test_git_endpoint.py",
    "tests/integration/test_first_hour.py",
    "tests/integration/test_claude_code.py",
    "tests/integration/test_cli.py",
    "tests/integration/test_agent_gemini.py",
    "tests/integration/test_sandbox.py",
    "tests/integration/test_runtime_config.py",
    "tests/integration/test_full_disk.py",
    "tests/integration/test_credentials_git.py",
    "tests/integration/test_agent_isolation.py",
    "tests/systemd/test_survival_systemd.py",
    "tests/integration/test_agentctl_server.py",
    "tests/integration/test_postgres.py",
    "tests/integration/test_hostile_workspaces.py",
    "tests/systemd/test_package_skew.py",
    "tests/integration/test_cli_human.py",
    "tests/integration/test_version_skew.py",
    "tests/integration/test_agent_codex.py",
    "tests/integration/test_survival_no_manager.py",
    "tests/integration/test_bad_input_and_config.py",
)


def module_rank(path: str) -> int:
    """Where the module at ``path`` (relative to the repository) goes: its place in
    ``LONGEST_FIRST``, else after all of them."""
    try:
        return LONGEST_FIRST.index(path)
    except ValueError:
        return len(LONGEST_FIRST)
