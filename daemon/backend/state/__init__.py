"""The backend's in-memory execution state: tracked agents and their identity, control-server events
applied to the store, and wake-ups for followers.
"""
