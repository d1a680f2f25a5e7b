"""The agent sandbox: bubblewrap around every agent, the user namespaces of a root control server,
and the environment (provider keys) an agent is given.
"""
