"""What ``kandev`` prints for people when ``--json`` is not given.

``term`` decides colour and width for a stream; ``table`` lays out aligned columns; ``status``,
``views`` and ``transcript`` render the results of the backend ops; ``errors`` turns a typed
error into ``kandev: <what went wrong>`` plus a hint; ``follow`` is the client of the backend's
``follow`` stream (reconnecting across backend restarts). Nothing here changes ``--json`` output.

``kandev`` imports these modules only for the commands that print for people; this package's own
import is kept free of them (the parser needs only ``RECONNECT_TIMEOUT_S``).
"""

RECONNECT_TIMEOUT_S = 60.0  # how long follow waits for a lost backend by default
