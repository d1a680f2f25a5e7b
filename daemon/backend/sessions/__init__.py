"""Sessions: start one, prompt it, cancel and stop it, resume it, change its runtime configuration,
reset its context, proceed through workflow steps, and the one launch pipeline that gives a
session an agent.
"""
