"""One backend lifetime: the context every part shares, the single-driver locks, the CLI socket, the
store's upkeep and start-up wait for space, the home's hygiene, and keeping the control server on
the installed version.
"""
