#!/bin/bash
# vendored unchanged from the team's shared sdbox tool (sdbox.sh); only this line was added
# sdbox.sh: boot a throw-away systemd (systemd-nspawn over a tmpfs-backed overlay of /, private
# mount/pid/net/ipc/uts/cgroup namespaces), run CMD on the host with SDBOX_LEADER set, tear down.
# usage: SDBOX_UNITS=dir-of-units SDBOX_SHARE=dir sdbox.sh CMD [ARGS...]
#   inside-box command from CMD:  nsenter -t "$SDBOX_LEADER" -a -r -w systemctl status foo
# needs: apt-get install systemd-container   (root; host systemd need not be PID 1)
set -euo pipefail
SELF=$(readlink -f "$0")
if [ "${1:-}" = __inner ]; then   # runs in a private mount namespace; nothing here is seen by the host
  LAB=$2 R=$2/root
  mount -t tmpfs -o mode=755 sdbox-run /run          # nspawn's host-side state (host /run is on disk)
  mount -t tmpfs -o size=2G,mode=755 sdbox-upper "$LAB/t"
  mkdir "$LAB/t/upper" "$LAB/t/work"
  mount -t overlay sdbox-root -o "lowerdir=/,upperdir=$LAB/t/upper,workdir=$LAB/t/work" "$R"
  systemd-id128 new > "$R/etc/machine-id"
  ln -sf /usr/lib/systemd/system/multi-user.target "$R/etc/systemd/system/default.target"
  for u in postgresql.service e2scrub_reap.service getty@tty1.service console-getty.service \
    apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer e2scrub_all.timer fstrim.timer \
    man-db.timer systemd-timesyncd.service systemd-pstore.service; do
    ln -sf /dev/null "$R/etc/systemd/system/$u"; done
  cp -r "$LAB/units/." "$R/etc/systemd/system/"
  exec systemd-nspawn --quiet --boot -D "$R" --machine="sdbox-${LAB##*.}" --register=no --keep-unit \
    --private-network --link-journal=no --console=passive --bind="$LAB/share:/sdbox"
fi
for cg in /sys/fs/cgroup/unified/sdbox-*; do    # reap boxes whose sdbox.sh died (e.g. SIGKILL)
  [ -d "$cg" ] || continue; o=${cg##*/sdbox-}; o=${o%%-*}; kill -0 "$o" 2>/dev/null && continue
  echo 1 > "$cg/cgroup.kill"; sleep 0.5; n=${cg##*/}
  find "$cg" "/sys/fs/cgroup/systemd/$n" -depth -type d -exec rmdir {} + 2>/dev/null || true
  rm -rf "/var/tmp/sdbox.${n##*-}" "/tmp/sdbox-marker-$o"; done
LAB=$(mktemp -d /var/tmp/sdbox.XXXXXX); CG=sdbox-$$-${LAB##*.}; MARK=/tmp/sdbox-marker-$$
mkdir -p "$LAB"/{t,root,units,share}; touch "$MARK"
[ -n "${SDBOX_UNITS:-}" ] && cp -r "$SDBOX_UNITS/." "$LAB/units/"
[ -n "${SDBOX_SHARE:-}" ] && cp -r "$SDBOX_SHARE/." "$LAB/share/"
BOX= LEADER= CMD=
cleanup() {
  local rc=$? i; set +e
  [ -n "$CMD" ] && kill "$CMD" 2>/dev/null && wait "$CMD" 2>/dev/null   # interrupted: stop the command
  [ -n "$LEADER" ] && kill -s RTMIN+3 "$LEADER" 2>/dev/null      # clean halt of the container
  for i in $(seq 100); do kill -0 "$BOX" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$BOX" 2>/dev/null; then echo "sdbox: halt timed out, killing" >&2
    echo 1 > "/sys/fs/cgroup/unified/$CG/cgroup.kill"; fi
  wait "$BOX" 2>/dev/null
  for i in $(seq 50); do find /sys/fs/cgroup/{systemd,unified}/$CG -depth -type d -exec rmdir {} + 2>/dev/null
    [ -d "/sys/fs/cgroup/unified/$CG" ] || [ -d "/sys/fs/cgroup/systemd/$CG" ] || break; sleep 0.1; done
  [ -e "$MARK" ] || { echo "sdbox: FATAL host /tmp marker vanished" >&2; rc=99; }
  rm -f "$MARK"; [ "$rc" = 0 ] || tail -n 30 "$LAB/console.log" >&2
  rm -rf "$LAB"; exit "$rc"
}
trap cleanup EXIT; trap 'exit 130' INT TERM HUP
for h in systemd unified; do mkdir "/sys/fs/cgroup/$h/$CG"; done   # keep the box out of the root cgroup
( for h in systemd unified; do echo "$BASHPID" > "/sys/fs/cgroup/$h/$CG/cgroup.procs"; done
  exec setpriv --pdeathsig KILL unshare --pid --fork --kill-child=SIGKILL --mount-proc \
       --mount --propagation private "$SELF" __inner "$LAB" ) </dev/null >"$LAB/console.log" 2>&1 &
BOX=$!      # if this script is SIGKILLed, pdeathsig -> unshare dies -> its pid namespace (box incl.) dies
for i in $(seq 200); do   # container PID 1 is the only process in payload/init.scope
  LEADER=$(cat "/sys/fs/cgroup/unified/$CG/payload/init.scope/cgroup.procs" 2>/dev/null | head -1) || true
  [ -n "$LEADER" ] && break; kill -0 "$BOX" 2>/dev/null || break; sleep 0.05; done
[ -n "$LEADER" ] || { echo "sdbox: container did not start" >&2; exit 1; }
for i in $(seq 600); do
  st=$(timeout 60 nsenter -t "$LEADER" -a -r -w systemctl is-system-running --wait 2>/dev/null) || true
  case "$st" in running|degraded) break;; esac; sleep 0.1; done
case "$st" in running|degraded) ;; *) echo "sdbox: boot failed: $st" >&2; exit 1;; esac
export SDBOX_LEADER=$LEADER SDBOX_LAB=$LAB
"$@" & CMD=$!
wait "$CMD"; CMD=
