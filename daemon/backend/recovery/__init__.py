"""Startup recovery: adopt a surviving control server only when it is provably ours, re-track its
agents, apply what finished while the backend was away, and repair what did not survive.
"""
