"""The control server: supervises agent processes and outlives its backend when asked to."""
