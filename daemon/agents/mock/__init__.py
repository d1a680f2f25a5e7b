"""The mock agent: a scriptable ACP agent for tests and the demo (``python -m daemon.agents.mock``).

It speaks ACP on stdio like a real agent; its prompts are commands (``/slow``, ``/flood N``, ``/sh``...)
that make it behave as the tests need, including attacks from inside its sandbox.
"""
