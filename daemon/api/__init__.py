"""The backend's CLI protocol: the one operation table ``kandev`` and the backend share (``ops``) and
its version (``version``), apart from both so that the CLI imports no backend code.
"""
