#!/usr/bin/env bash
# Replicated set-ups on loopback, for tests/replicated.rs: a 3-node MariaDB Galera cluster and a
# PostgreSQL primary with a synchronous standby. Each has its own data directories (under
# $DBLOCK_REPLICATED_DIR, default /tmp/dblock-replicated) and its own ports; the shared servers on
# 3306 and 5432 are never touched. The servers run as their service users (mysql, postgres), so
# their data, sockets and logs live outside the checkout, which those users may not be able to
# enter (a clone under `mktemp -d` is 0700 root's). Needs root.
#
#   scripts/replicated.sh test [ARGS]     the one command: install what is missing, build the test,
#                                         bring both set-ups up, run tests/replicated.rs (ARGS go
#                                         to the test binary), tear everything down (also on error
#                                         or Ctrl-C)
#   scripts/replicated.sh install         apt-get the packages that are missing (galera-4, rsync, ...)
#   scripts/replicated.sh up [galera|postgres|all]
#                                         start and wait until ready: Galera wsrep_cluster_size=3,
#                                         all Synced; PostgreSQL standby streaming and `sync`
#   scripts/replicated.sh env             `export` lines for the URLs of what is up:
#                                         eval "$(scripts/replicated.sh env)"
#   scripts/replicated.sh status
#   scripts/replicated.sh kill-node N     kill -9 the mariadbd of Galera node N (1-3)
#   scripts/replicated.sh start-node N    start node N again (it rejoins by IST) and wait for Synced
#   scripts/replicated.sh failover [S]    PostgreSQL: stop the primary (immediate), promote the
#                                         standby; with S, stop the walsender S seconds first
#   scripts/replicated.sh down            stop every server of these set-ups, delete their data
#
# Ports: Galera node i listens on 331i (SQL), 457i (group communication), 458i (SST), 459i (IST);
# PostgreSQL primary 5433, standby 5434. Measurements go to stdout as `name=value` lines, progress
# to stderr.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF="$REPO/scripts/replicated.sh"
# Outside the checkout, wherever it is; absolute, since `ours` finds the servers by it.
DIR=${DBLOCK_REPLICATED_DIR:-/tmp/dblock-replicated}
case $DIR in /*) ;; *) DIR=$PWD/$DIR ;; esac
PGBIN=/usr/lib/postgresql/15/bin
MARIADBD=/usr/sbin/mariadbd
GALERA_PROVIDER=/usr/lib/galera/libgalera_smm.so
NODES=(1 2 3)
PG_PRIMARY_PORT=5433
PG_STANDBY_PORT=5434
READY_TIMEOUT=180

log() { printf '==> [%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { printf 'replicated.sh: %s\n' "$*" >&2; exit 1; }
now_ms() { date +%s%3N; }

# wait_until <seconds> <what> <command...>: polls every 0.2 s.
wait_until() {
    local limit=$1 what=$2; shift 2
    local deadline=$(($(now_ms) + limit * 1000))
    until "$@" >/dev/null 2>&1; do
        if [ "$(now_ms)" -ge "$deadline" ]; then
            log "$what: not after ${limit} s"
            return 1
        fi
        sleep 0.2
    done
}

# Free: nothing accepts a connection on it.
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

require_ports_free() {
    local p
    for p in "$@"; do
        port_free "$p" || die "port $p is in use (a server of an earlier run? try: $SELF down)"
    done
}

# A process of ours: alive, run by mysql or postgres, and its command line names our directory
# (mariadbd, postgres, the SST helpers all do). A pid file may be stale and its number reused.
ours() { # ours <pid> [directory, default $DIR]
    local pid=$1 dir=${2:-$DIR} args=()
    [ -n "$pid" ] || return 1
    mapfile -d '' args 2>/dev/null <"/proc/$pid/cmdline" || return 1
    [[ "${args[*]}" == *"$dir/"* ]] || return 1
    case $(stat -c %U "/proc/$pid" 2>/dev/null) in
    mysql | postgres) return 0 ;;
    *) return 1 ;;
    esac
}

our_pids() { # our_pids <directory>
    local f pid
    for f in /proc/[0-9]*; do
        pid=${f#/proc/}
        if ours "$pid" "$1"; then echo "$pid"; fi
    done
}

# Kills every process of ours under <directory> (kill -9, repeated until none is left), then
# deletes it.
sweep() {
    local pid left
    for _ in $(seq 1 50); do
        left=$(our_pids "$1")
        [ -z "$left" ] && break
        for pid in $left; do kill -9 "$pid" 2>/dev/null || true; done
        sleep 0.2
    done
    [ -z "$left" ] || log "down: still running after 10 s: $left"
    rm -rf "$1"
}

pid_in() { [ -s "$1" ] && head -n1 "$1" | tr -dc '0-9' || true; }

# $DIR, if there: a directory of root's. In a world-writable /tmp, a path someone else made first
# (or a symlink) is refused before anything is created or deleted in it, teardown included.
check_dir() {
    if [ -L "$DIR" ] || { [ -e "$DIR" ] && [ ! -d "$DIR" ]; }; then
        die "$DIR exists and is not a directory: remove it or set DBLOCK_REPLICATED_DIR"
    fi
    if [ -e "$DIR" ] && [ "$(stat -c %u "$DIR")" != 0 ]; then
        die "$DIR belongs to $(stat -c %U "$DIR"), not root: remove it or set DBLOCK_REPLICATED_DIR"
    fi
}

# $DIR itself: root's, mode 0755 (each set-up's directory below it is its server user's).
make_dir() {
    install -d -m 0755 "$DIR"
    check_dir
    chmod 0755 "$DIR"
}

# The server user must be able to enter $DIR: every directory above it must let others through.
require_reachable() { # require_reachable <user>
    (cd / && runuser -u "$1" -- test -x "$DIR") ||
        die "the $1 user cannot enter $DIR (a directory above it is closed to others): set DBLOCK_REPLICATED_DIR to a directory outside it"
}

# ---------------------------------------------------------------------------------------------
# Packages

cmd_install() {
    local missing=()
    [ -e "$GALERA_PROVIDER" ] || missing+=(galera-4)
    command -v rsync >/dev/null || missing+=(rsync)
    [ -x "$MARIADBD" ] || missing+=(mariadb-server)
    command -v mariadb >/dev/null || missing+=(mariadb-client)
    [ -x "$PGBIN/postgres" ] || missing+=(postgresql-15)
    if [ "${#missing[@]}" -eq 0 ]; then
        log "packages: all present"
        return
    fi
    log "packages: installing ${missing[*]}"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
}

# ---------------------------------------------------------------------------------------------
# Galera

node_dir() { echo "$DIR/galera/n$1"; }

node_sql() { # node_sql <i> <sql>: as root over the node's own socket
    mariadb --no-defaults --socket="$(node_dir "$1")/mysqld.sock" -uroot -N -B -e "$2"
}

node_status() { # node_status <i> <variable>
    node_sql "$1" "SHOW GLOBAL STATUS LIKE '$2'" 2>/dev/null | awk '{print $2}'
}

node_synced() { # node_synced <i> <cluster size>
    [ "$(node_status "$1" wsrep_ready)" = ON ] &&
        [ "$(node_status "$1" wsrep_local_state_comment)" = Synced ] &&
        [ "$(node_status "$1" wsrep_cluster_size)" = "$2" ]
}

write_node_cnf() {
    local i=$1 d
    d=$(node_dir "$i")
    cat >"$DIR/galera/n$i.cnf" <<EOF
[mariadbd]
datadir=$d/data
socket=$d/mysqld.sock
pid-file=$d/mysqld.pid
log-error=$d/error.log
tmpdir=$d/tmp
port=331$i
bind-address=127.0.0.1
user=mysql
skip-name-resolve
binlog_format=ROW
default_storage_engine=InnoDB
innodb_autoinc_lock_mode=2
innodb_buffer_pool_size=128M
innodb_flush_log_at_trx_commit=2
wsrep_on=ON
wsrep_provider=$GALERA_PROVIDER
wsrep_cluster_name=dblock_replicated
wsrep_cluster_address=gcomm://127.0.0.1:4571,127.0.0.1:4572,127.0.0.1:4573
wsrep_node_name=n$i
wsrep_node_address=127.0.0.1:457$i
wsrep_node_incoming_address=127.0.0.1:331$i
wsrep_sst_receive_address=127.0.0.1:458$i
wsrep_provider_options="gmcast.listen_addr=tcp://127.0.0.1:457$i;ist.recv_addr=127.0.0.1:459$i;gcache.size=64M"
wsrep_sst_method=rsync
wsrep_slave_threads=4
EOF
}

# Starts node i in a session of its own: a Ctrl-C meant for this script reaches the trap that
# tears it down, not the server.
start_node() {
    local i=$1; shift
    setsid "$MARIADBD" --defaults-file="$DIR/galera/n$i.cnf" "$@" \
        </dev/null >>"$(node_dir "$i")/stdout.log" 2>&1 &
}

wait_node() { # wait_node <i> <cluster size>
    if ! wait_until "$READY_TIMEOUT" "Galera node $1 Synced in a cluster of $2" node_synced "$1" "$2"; then
        tail -n 30 "$(node_dir "$1")/error.log" >&2 || true
        return 1
    fi
}

up_galera() {
    local t0 i
    t0=$(now_ms)
    # Whatever an earlier run left behind (killed before its teardown) goes first.
    down_galera
    require_ports_free 3311 3312 3313 4571 4572 4573 4581 4582 4583 4591 4592 4593
    require_reachable mysql
    install -d -m 0755 "$DIR/galera"
    for i in "${NODES[@]}"; do
        install -d -o mysql -g mysql -m 0750 "$(node_dir "$i")" "$(node_dir "$i")/tmp"
        write_node_cnf "$i"
        chown mysql:mysql "$DIR/galera/n$i.cnf"
    done
    log "Galera: mariadb-install-db x3"
    local installs=()
    for i in "${NODES[@]}"; do
        mariadb-install-db --defaults-file="$DIR/galera/n$i.cnf" --user=mysql \
            --auth-root-authentication-method=normal >"$(node_dir "$i")/install.log" 2>&1 &
        installs+=($!)
    done
    for i in "${!installs[@]}"; do
        if ! wait "${installs[$i]}"; then
            head -n 40 "$(node_dir $((i + 1)))/install.log" >&2
            die "mariadb-install-db failed for node $((i + 1))"
        fi
    done
    log "Galera: n1 bootstraps the cluster"
    start_node 1 --wsrep-new-cluster
    wait_node 1 1
    node_sql 1 "CREATE DATABASE IF NOT EXISTS test;
        CREATE USER IF NOT EXISTS 'dblock'@'127.0.0.1';
        GRANT ALL ON test.* TO 'dblock'@'127.0.0.1'"
    for i in 2 3; do
        log "Galera: n$i joins (rsync SST)"
        start_node "$i"
        wait_node "$i" "$i"
    done
    touch "$DIR/galera/up"
    echo "galera_up_ms=$(($(now_ms) - t0))"
}

cmd_kill_node() {
    local i=${1:?node number} pid
    pid=$(pid_in "$(node_dir "$i")/mysqld.pid")
    ours "$pid" || die "Galera node $i is not running"
    kill -9 "$pid"
    log "Galera: kill -9 n$i (pid $pid)"
    echo "killed_pid=$pid"
}

cmd_start_node() {
    local i=${1:?node number} t0
    t0=$(now_ms)
    ours "$(pid_in "$(node_dir "$i")/mysqld.pid")" && die "Galera node $i is running"
    start_node "$i"
    wait_node "$i" 3
    echo "rejoin_ms=$(($(now_ms) - t0))"
}

# ---------------------------------------------------------------------------------------------
# PostgreSQL

as_postgres() { (cd / && runuser -u postgres -- "$@"); }

pg_sql() { # pg_sql <port> <sql>
    as_postgres "$PGBIN/psql" -X -q -h 127.0.0.1 -p "$1" -U postgres -d postgres -tAc "$2"
}

pg_sync_standby() {
    [ "$(pg_sql $PG_PRIMARY_PORT "SELECT application_name || '|' || state || '|' || sync_state
        FROM pg_stat_replication")" = "standby1|streaming|sync" ]
}

up_postgres() {
    local t0 pg=$DIR/pg
    t0=$(now_ms)
    down_postgres
    require_ports_free $PG_PRIMARY_PORT $PG_STANDBY_PORT
    require_reachable postgres
    install -d -o postgres -g postgres -m 700 "$pg"
    log "PostgreSQL: initdb, primary on $PG_PRIMARY_PORT"
    as_postgres "$PGBIN/initdb" -D "$pg/primary" -A trust -U postgres --no-sync >"$pg/initdb.log" 2>&1
    cat >>"$pg/primary/postgresql.conf" <<EOF
port = $PG_PRIMARY_PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$pg'
wal_level = replica
max_wal_senders = 5
synchronous_commit = on
EOF
    as_postgres "$PGBIN/pg_ctl" -D "$pg/primary" -l "$pg/primary.log" -w -t 60 start >/dev/null
    # Before the standby exists, so this commit does not wait for it.
    pg_sql $PG_PRIMARY_PORT "CREATE DATABASE test" >/dev/null
    log "PostgreSQL: pg_basebackup, standby on $PG_STANDBY_PORT"
    as_postgres "$PGBIN/pg_basebackup" -h 127.0.0.1 -p $PG_PRIMARY_PORT -U postgres \
        -D "$pg/standby" -R -X stream -c fast
    # postgresql.auto.conf is read last: these win over what the copy brought along.
    # synchronous_standby_names='' so that, once promoted, its commits do not wait for a standby
    # that no longer exists.
    cat >>"$pg/standby/postgresql.auto.conf" <<EOF
port = $PG_STANDBY_PORT
primary_conninfo = 'host=127.0.0.1 port=$PG_PRIMARY_PORT user=postgres application_name=standby1'
synchronous_standby_names = ''
EOF
    as_postgres "$PGBIN/pg_ctl" -D "$pg/standby" -l "$pg/standby.log" -w -t 60 start >/dev/null
    pg_sql $PG_PRIMARY_PORT "ALTER SYSTEM SET synchronous_standby_names = 'standby1'" >/dev/null
    pg_sql $PG_PRIMARY_PORT "SELECT pg_reload_conf()" >/dev/null
    wait_until "$READY_TIMEOUT" "PostgreSQL standby streaming, sync" pg_sync_standby
    touch "$pg/up"
    echo "postgres_up_ms=$(($(now_ms) - t0))"
}

# failover [STALL_SECONDS]: with STALL_SECONDS, the primary's walsender is stopped (SIGSTOP) that
# long before the primary is: commits then wait for the standby, and those in flight at the stop
# exist on the primary only (the worst moment). pg_ctl's immediate stop then waits about 5 s for
# the stopped walsender before the postmaster kills it.
cmd_failover() {
    local pg=$DIR/pg stall=${1:-} walsender t0 t1 t2
    [ -f "$pg/up" ] || die "PostgreSQL set-up is not up"
    if [ -n "$stall" ]; then
        walsender=$(pg_sql $PG_PRIMARY_PORT "SELECT pid FROM pg_stat_replication
            WHERE application_name = 'standby1'")
        ours "$(pid_in "$pg/primary/postmaster.pid")" && [ -n "$walsender" ] ||
            die "no walsender on the primary"
        kill -STOP "$walsender"
        log "PostgreSQL: walsender $walsender stopped for $stall s"
        sleep "$stall"
    fi
    t0=$(now_ms)
    as_postgres "$PGBIN/pg_ctl" -D "$pg/primary" -m immediate stop >/dev/null
    t1=$(now_ms)
    as_postgres "$PGBIN/pg_ctl" -D "$pg/standby" -w -t 60 promote >/dev/null
    t2=$(now_ms)
    log "PostgreSQL: primary stopped (immediate) in $((t1 - t0)) ms, standby promoted in $((t2 - t1)) ms"
    echo "stop_ms=$((t1 - t0))"
    echo "promote_ms=$((t2 - t1))"
}

# ---------------------------------------------------------------------------------------------
# Up, down, env

bring_up() {
    make_dir
    case $1 in
    galera) up_galera ;;
    postgres) up_postgres ;;
    all)
        up_galera
        up_postgres
        ;;
    *) die "up: galera, postgres or all, not $1" ;;
    esac
}

cmd_up() {
    # A failed start leaves nothing running (unless DBLOCK_REPLICATED_KEEP=1, to look at the logs).
    if [ "${DBLOCK_REPLICATED_KEEP:-}" != 1 ]; then
        trap 'log "up failed: tearing down (DBLOCK_REPLICATED_KEEP=1 keeps it)"; cmd_down' EXIT
    fi
    bring_up "${1:-all}"
    trap - EXIT
}

down_galera() {
    # mariadbd and its SST helpers all name their directory.
    sweep "$DIR/galera"
}

down_postgres() {
    local d
    # By PostgreSQL's own tool first (its child processes do not name their directory), then
    # whatever is left (a postmaster pg_ctl could not stop).
    for d in "$DIR/pg/primary" "$DIR/pg/standby"; do
        if ours "$(pid_in "$d/postmaster.pid")"; then
            as_postgres "$PGBIN/pg_ctl" -D "$d" -m immediate -t 20 stop >/dev/null 2>&1 || true
        fi
    done
    sweep "$DIR/pg"
}

cmd_down() {
    local t0 t1
    t0=$(now_ms)
    down_galera
    t1=$(now_ms)
    down_postgres
    # Gone when empty (nothing else was put there).
    rmdir "$DIR" 2>/dev/null || true
    log "down: done (Galera $((t1 - t0)) ms, PostgreSQL $(($(now_ms) - t1)) ms)"
}

cmd_env() {
    if [ -f "$DIR/galera/up" ]; then
        echo "export DBLOCK_GALERA_URLS=mysql://dblock@127.0.0.1:3311/test,mysql://dblock@127.0.0.1:3312/test,mysql://dblock@127.0.0.1:3313/test"
    fi
    if [ -f "$DIR/pg/up" ]; then
        echo "export DBLOCK_PG_PRIMARY_URL=postgres://postgres@127.0.0.1:$PG_PRIMARY_PORT/test"
        echo "export DBLOCK_PG_STANDBY_URL=postgres://postgres@127.0.0.1:$PG_STANDBY_PORT/test"
    fi
    echo "export DBLOCK_REPLICATED_CTL=$SELF"
    echo "export DBLOCK_REPLICATED_DIR=$DIR"
}

cmd_status() {
    local i
    for i in "${NODES[@]}"; do
        if node_sql "$i" "SELECT 1" >/dev/null 2>&1; then
            echo "galera n$i: $(node_status "$i" wsrep_local_state_comment), cluster size $(node_status "$i" wsrep_cluster_size)"
        else
            echo "galera n$i: down"
        fi
    done
    for port in $PG_PRIMARY_PORT $PG_STANDBY_PORT; do
        if pg_sql "$port" "SELECT 1" >/dev/null 2>&1; then
            echo "postgres $port: in recovery $(pg_sql "$port" "SELECT pg_is_in_recovery()"), replicas: $(pg_sql "$port" "SELECT string_agg(application_name || ' ' || sync_state, ', ') FROM pg_stat_replication")"
        else
            echo "postgres $port: down"
        fi
    done
}

# The whole thing, torn down whatever happens.
cmd_test() {
    local t0 t1 t2 t3
    t0=$(now_ms)
    cmd_install
    # The build the README's `cargo nextest run --workspace --all-features` (run by CI before
    # this) makes: nextest builds with `cargo test --no-run` and the same flags.
    log "building the test"
    (cd "$REPO" && cargo test --workspace --all-features --test replicated --no-run)
    t1=$(now_ms)
    trap 'cmd_down' EXIT
    trap 'exit 130' INT TERM
    bring_up all
    t2=$(now_ms)
    eval "$(cmd_env)"
    log "running tests/replicated.rs"
    (cd "$REPO" && DBLOCK_REQUIRE_REPLICATED=1 \
        cargo test --workspace --all-features --test replicated -- --nocapture --test-threads=1 \
        --skip patroni_failover "$@")
    t3=$(now_ms)
    cmd_down
    trap - EXIT
    echo "build_ms=$((t1 - t0)) up_ms=$((t2 - t1)) test_ms=$((t3 - t2)) down_ms=$(($(now_ms) - t3)) total_ms=$(($(now_ms) - t0))"
}

[ "$(id -u)" = 0 ] || die "run as root (the servers are started as the mysql and postgres users)"
check_dir
command=${1:-}
[ $# -gt 0 ] && shift
case $command in
install) cmd_install ;;
up) cmd_up "$@" ;;
down) cmd_down ;;
env) cmd_env ;;
status) cmd_status ;;
kill-node) cmd_kill_node "$@" ;;
start-node) cmd_start_node "$@" ;;
failover) cmd_failover "$@" ;;
test) cmd_test "$@" ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
