"""What ``kandev`` prints for people when ``--json`` is not given.

``term`` decides colour and width for a stream; ``table`` lays out aligned columns; ``status``,
``views`` and ``transcript`` render the results of the backend ops; ``errors`` turns a typed
error into ``kandev: <what went wrong>`` plus a hint; ``follow`` is the client of the backend's
``follow`` stream (reconnecting across backend restarts). Nothing here changes ``--json`` output.
"""
