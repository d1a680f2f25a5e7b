"""Each agent's egress proxy, in the control server: the Unix socket per instance its sandbox's relay
hands connections to, the HTTP proxy that judges each one against the instance's network policy
(``daemon.agents.network``), and the refusals it reports.
"""
