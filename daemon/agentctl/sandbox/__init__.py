"""The agent sandbox: bubblewrap around every agent, the user namespaces of a root control server,
its own network namespace with the relay to its egress proxy, and the environment (provider keys)
an agent is given.
"""
