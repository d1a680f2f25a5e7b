"""The backend's thin op handlers: each reads a request of the CLI protocol (``daemon.api.ops``) and
calls the service that does the work.
"""
