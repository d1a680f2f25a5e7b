"""Reload: the control server replaces its code in place (re-exec) while every agent keeps running:
the preload, the preflight, the hand-over of each instance and the new image's resume.
"""
