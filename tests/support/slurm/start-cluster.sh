#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, with accounting, for the live SLURM test
# (tests/e2e/test_slurm.py). Needs root.
#
#   tests/support/slurm/start-cluster.sh      # install (Debian packages), configure, start
#   tests/support/slurm/stop-cluster.sh       # stop the daemons
#
# Idempotent: a second call keeps what runs with an unchanged config. It installs
# slurm-wlm, slurmdbd, munge and mariadb-server with apt-get (Debian bookworm: Slurm
# 22.05, ~40 s), writes /etc/slurm/slurm.conf for one node, `localhost`, with this
# machine's CPUs and memory (`slurmd -C`), and starts munged, MariaDB, slurmdbd,
# slurmctld and slurmd, then waits until `sinfo` shows the node idle. slurmdbd is what
# makes `sacct` list jobs: without it Slurm 22.05's sacct only says "Slurm accounting
# storage is disabled" (there is no file-based accounting storage any more).
# On failure: one line naming the step and its log, exit status 1.
set -euo pipefail

CLUSTER=planner-test
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
DB_PASS=planner-test-only   # a local database reachable through its socket only
say() { echo "start-cluster: $*" >&2; }
die() { say "$*"; exit 1; }
running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_for() {  # seconds command...: until the command succeeds
    local n=$(( $1 * 10 )); shift
    for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
    "$@" >/dev/null 2>&1
}

[ "$(id -u)" = 0 ] || die "needs root (apt-get, /etc/slurm, the daemons)"

pkgs=(slurm-wlm slurmdbd munge mariadb-server)
missing=()
for p in "${pkgs[@]}"; do dpkg-query -W -f '${Status}' "$p" 2>/dev/null \
    | grep -q "install ok installed" || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
fi

# --- munge: a key, then munged as the munge user
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
munge_ok() { munge -n | unmunge; }
if ! munge_ok >/dev/null 2>&1; then
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged || die "munged did not start (see /var/log/munge/)"
    wait_for 5 munge_ok || die "munge credentials do not round-trip"
fi

# --- MariaDB for slurmdbd
install -d -o mysql -g mysql -m 0755 /run/mysqld
if ! mariadb-admin ping >/dev/null 2>&1; then
    say "starting MariaDB"
    runuser -u mysql -- /usr/sbin/mariadbd --pid-file=/run/mysqld/mysqld.pid \
        --socket=/run/mysqld/mysqld.sock --skip-networking \
        >>/var/log/slurm-mariadb.log 2>&1 &
    wait_for 30 mariadb-admin ping || die "MariaDB did not start (see /var/log/slurm-mariadb.log)"
fi
mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" \
    || die "cannot create the slurm database user"

# --- configs: one node, this machine's CPUs and memory
node=$(slurmd -C | head -1) || die "slurmd -C failed"
field() { sed -n "s/.*\\b$1=\\([0-9]*\\).*/\\1/p" <<<"$node"; }
cpus=$(field CPUs); sockets=$(field SocketsPerBoard); cores=$(field CoresPerSocket)
threads=$(field ThreadsPerCore); mem=$(field RealMemory)
[ -n "$cpus" ] && [ -n "$mem" ] || die "cannot read CPUs / RealMemory from: $node"

install -d -o slurm -g slurm -m 0755 /var/spool/slurmctld /var/log/slurm /run/slurm
install -d -m 0755 /var/spool/slurmd
changed=0
put() {  # path mode owner: stdin -> path; changed=1 when the content differs
    local new; new=$(mktemp)
    cat >"$new"
    cmp -s "$new" "$1" || changed=1
    install -m "$2" -o "$3" -g "$3" "$new" "$1"; rm -f "$new"
}
put "$DBD_CONF" 0600 slurm <<CONF_EOF
# Written by tests/support/slurm/start-cluster.sh.
AuthType=auth/munge
DbdHost=localhost
SlurmUser=slurm
PidFile=/run/slurm/slurmdbd.pid
LogFile=/var/log/slurm/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=$DB_PASS
CONF_EOF
put "$CONF" 0644 root <<CONF_EOF
# Written by tests/support/slurm/start-cluster.sh: a one-node cluster for the live SLURM test.
ClusterName=$CLUSTER
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/none
MinJobAge=3600
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus SocketsPerBoard=${sockets:-1} CoresPerSocket=${cores:-$cpus} ThreadsPerCore=${threads:-1} RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF_EOF

if [ "$changed" = 1 ]; then  # a new config: stop what runs with the old one
    for d in slurmd slurmctld slurmdbd; do
        if running "/run/slurm/$d.pid"; then
            pid=$(cat "/run/slurm/$d.pid"); kill "$pid"
            wait_for 10 bash -c "! kill -0 $pid" || die "$d ($pid) does not stop"
        fi
    done
fi

# --- daemons: slurmdbd, the cluster in its database, slurmctld, slurmd
if ! running /run/slurm/slurmdbd.pid; then
    say "starting slurmdbd"
    slurmdbd || die "slurmdbd did not start (see /var/log/slurm/slurmdbd.log)"
fi
wait_for 30 sacctmgr -n list cluster || die "slurmdbd does not answer (see /var/log/slurm/slurmdbd.log)"
if [ -z "$(sacctmgr -n -P list cluster "$CLUSTER" format=cluster)" ]; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster $CLUSTER failed"
fi
if ! running /run/slurm/slurmctld.pid; then
    say "starting slurmctld"
    slurmctld || die "slurmctld did not start (see /var/log/slurm/slurmctld.log)"
fi
if ! running /run/slurm/slurmd.pid; then
    say "starting slurmd"
    slurmd -N localhost || die "slurmd did not start (see /var/log/slurm/slurmd.log)"
fi

state=
for _ in $(seq 120); do
    state=$(sinfo -h -n localhost -o %t 2>/dev/null || true)
    case "$state" in
        idle|mix|alloc) break ;;
        down*|drain*) scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
done
case "$state" in
    idle|mix|alloc) ;;
    *) die "node localhost not idle after 60 s (sinfo state '${state:-none}'; see /var/log/slurm/)" ;;
esac
sacct -n -X -S now-1hour >/dev/null || die "sacct cannot list jobs (see /var/log/slurm/slurmdbd.log)"
say "cluster $CLUSTER up: node localhost, $cpus CPUs, $mem MB, partition debug ($state)"
