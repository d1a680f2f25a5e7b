"""Operator settings: the declaration of every key (``keys``), the TOML file and its validation
(``settings``), the control server's share of them (``agentctl``) and the platform check of the
survival capability (``platform``).
"""
