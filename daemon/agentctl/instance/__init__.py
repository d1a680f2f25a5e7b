"""One agent's life in the control server: its process, pipes, ACP conversation, events, stderr and
logs (the instance owns them all).
"""
