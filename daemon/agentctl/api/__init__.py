"""The control server's thin op handlers: instances, event streams, ownership and reload.
"""
