"""The backend's control servers: starting one in the lifetime the capability asks for, the link to
it (an explicit state machine), and watching whether it is still there.
"""
