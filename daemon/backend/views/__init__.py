"""What the backend shows people and scripts: task and session lists, one session's page, short ids,
and the ``follow`` stream.
"""
