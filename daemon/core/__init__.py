"""What every kandev process shares: the version, structured logging to the journal, the daemon
skeleton, process limits, the garbage collector's settings and fault injection.
"""
