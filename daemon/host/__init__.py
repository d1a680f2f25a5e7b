"""The host as kandev sees it: the Kandev home and its paths, the agents' host user, a session's
private directories, and process identities.
"""
