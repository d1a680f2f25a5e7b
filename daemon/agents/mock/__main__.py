"""``python -m daemon.agents.mock``: the mock agent on stdio (``daemon.agents.mock.agent.main``)."""

from daemon.agents.mock.agent import main

main()
