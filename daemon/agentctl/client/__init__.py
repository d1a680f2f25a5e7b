"""The backend's client of the control server: the connection, its ownership handshake, the shared
event streams and the typed replies.
"""
