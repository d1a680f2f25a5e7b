"""The version of the backend's CLI protocol, on its own: every ``kandev`` call sends its major, and
the quick path of the CLI (``daemon.cli.quick``) must not import ``daemon.api.ops`` for it (that
module's enums cost a call ~4 ms)."""

from __future__ import annotations

PROTOCOL = "kandev-backend"
VERSION = (1, 7)  # 1.1 (release 0.2.0): agentctl_reload; 1.2: LIFECYCLE_OPS, shutdown agents, task_list attention; 1.3: store_vacuum, status.store; 1.4: JSON frames (ipc.codec_json); 1.5: config_show; 1.6: hosts, status.cluster, host and host_state in the lists, session_start host; 1.7: session_logs wait_s, session_show on_this_host; fields are only ever added
