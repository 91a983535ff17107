#!/usr/bin/env bash
# Stop the daemons tests/support/slurm/start-cluster.sh started (slurmd, slurmctld, slurmdbd,
# MariaDB, munged), each by the pid it recorded. Idempotent; packages, configs and the
# accounting database stay.
set -uo pipefail
stop() {  # pidfile name
    local pid
    [ -f "$1" ] || return 0
    pid=$(cat "$1")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "stop-cluster: $2 ($pid) did not stop within 10 s" >&2
            return 1
        fi
    fi
    rm -f "$1"
}
status=0
stop /run/slurm/slurmd.pid slurmd || status=1
stop /run/slurm/slurmctld.pid slurmctld || status=1
stop /run/slurm/slurmdbd.pid slurmdbd || status=1
stop /run/mysqld/mysqld.pid MariaDB || status=1
stop /run/munge/munged.pid munged || status=1
exit $status
