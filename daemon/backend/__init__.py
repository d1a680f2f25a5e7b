"""The backend: store, CLI socket, control-server lifetime and startup recovery."""
