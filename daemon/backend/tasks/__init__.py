"""Tasks: create one with its workspace, mark it done or take it back, and delete it.
"""
