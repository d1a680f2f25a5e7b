"""The registry of built-in agents (daemon/agents/registry.py)."""

from __future__ import annotations

import sys

import pytest

from daemon.agents.registry import get_agent


def test_mock_agent_runs_as_a_module_of_this_interpreter():
    agent = get_agent("mock")
    assert agent.name == "mock"
    assert agent.version
    assert agent.argv() == [sys.executable, "-m", "daemon.agents.mock"]


def test_unknown_agent_is_a_keyerror_naming_the_known_ones():
    with pytest.raises(KeyError, match="unknown agent 'nope'.*mock"):
        get_agent("nope")
