#!/usr/bin/env bash
# PostgreSQL as production runs it, on one machine: three nodes managed by Patroni (3.0) on one
# etcd (3.4), reached through HAProxy (2.6), which routes to the leader by Patroni's REST health
# check (`OPTIONS /primary`), as Patroni's own documentation sets it up. For tests/replicated.rs's
# `patroni_*` chaos runs: switchover, the leader killed (SIGKILL), the leader's network cut; and
# a switchover to a node whose PostgreSQL clock is ahead.
#
# Each node runs in a network namespace of its own (`dblock-pN`, address 10.78.0.1N on a bridge
# `dblock-br` whose host side, 10.78.0.1, runs etcd), so that "the leader's network is cut" is
# real: its link goes down and every packet to and from it is dropped (not refused), as when a
# machine falls off the network. HAProxy listens on 127.0.0.1:5440. The data directories are
# under $DBLOCK_PATRONI_DIR (default /tmp/dblock-patroni); the shared servers on 5432 and 3306
# are never touched. Needs root (namespaces; the servers run as the postgres user).
#
#   scripts/patroni.sh test [sync|async|both] [ARGS]
#                               the one command: install what is missing, build the test, bring
#                               the cluster up, run the chaos runs of the mode(s) (default both;
#                               `patroni_failover`, `patroni_failover_fenced_writes_and_steals`,
#                               then `patroni_failover_to_a_clock_ahead`; ARGS go to the test
#                               binary), tear down (also on error or Ctrl-C)
#   scripts/patroni.sh install  apt-get what is missing (patroni, etcd-server, haproxy, iproute2,
#                               faketime)
#   scripts/patroni.sh up       start and wait until ready: a leader, two streaming replicas
#   scripts/patroni.sh env      `export` lines for the test: eval "$(scripts/patroni.sh env)"
#   scripts/patroni.sh status   patronictl list
#   scripts/patroni.sh mode sync|async
#                               synchronous_mode on or off, and wait until it took effect
#   scripts/patroni.sh leader   the leader's node number
#   scripts/patroni.sh switchover
#                               planned: patronictl switchover to a replica; waits for the new
#                               leader behind HAProxy
#   scripts/patroni.sh switchover-to N
#                               planned, to node N (in synchronous mode the other replica is
#                               tagged `nosync` until N is the synchronous standby, then untagged);
#                               waits for N writable behind HAProxy
#   scripts/patroni.sh clock N OFFSET
#                               steps node N's PostgreSQL clock (node 3 only): its time of day
#                               becomes the real one plus OFFSET (libfaketime's `+60s`, `-10s`,
#                               `+0`), at once: its backends read the offset at every call
#   scripts/patroni.sh kill-leader
#                               SIGKILL Patroni and PostgreSQL of the leader's node (a crash)
#   scripts/patroni.sh cut-leader
#                               the leader's link down (its packets dropped) until another node
#                               leads and it has demoted itself
#   scripts/patroni.sh heal N   node N's link up again
#   scripts/patroni.sh start-node N
#                               Patroni of node N again (it rejoins as a replica, by pg_rewind
#                               if it must)
#   scripts/patroni.sh wait-replicas
#                               until every node runs and streams from the leader
#   scripts/patroni.sh down     stop everything, delete the namespaces, the bridge and the data
#
# Node 3's PostgreSQL runs under libfaketime (Patroni itself does not): its `bin_dir` is a
# directory of symlinks to $PGBIN but for `postgres`, a wrapper that execs the real one with
# libfaketime preloaded, reading its offset from a file at every call (`+0` at bring-up;
# the monotonic clock is left alone). Node 1 bootstraps the cluster, so node 3 starts as a
# replica. Step its clock only while its postmaster runs: a postmaster started under an offset
# writes its stepped start time into postmaster.pid, which Patroni compares with the process's
# real one when it reads that file again.
#
# Measurements go to stdout as `name=value` lines, progress to stderr.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF="$REPO/scripts/patroni.sh"
DIR=${DBLOCK_PATRONI_DIR:-/tmp/dblock-patroni}
case $DIR in /*) ;; *) DIR=$PWD/$DIR ;; esac
PGBIN=/usr/lib/postgresql/15/bin
NODES=(1 2 3)
BRIDGE=dblock-br
HOST_IP=10.78.0.1
ETCD_PORT=2479
ETCD_PEER_PORT=2480
HAPROXY_PORT=5440
READY_TIMEOUT=120
# Patroni's timing: the leader key lives TTL s unless renewed (every LOOP_WAIT s); a leader
# that cannot reach etcd for RETRY_TIMEOUT s demotes itself (RETRY_TIMEOUT*2 + LOOP_WAIT <= TTL).
TTL=10
LOOP_WAIT=1
RETRY_TIMEOUT=4
# The node whose PostgreSQL clock `clock` steps, and libfaketime (package faketime).
CLOCK_NODE=3
FAKETIME_LIB=/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1

log() { printf '==> [%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { printf 'patroni.sh: %s\n' "$*" >&2; exit 1; }
now_ms() { date +%s%3N; }

wait_until() { # wait_until <seconds> <what> <command...>: polls every 0.2 s
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

node_ip() { echo "10.78.0.1$1"; }
netns() { echo "dblock-p$1"; }
veth() { echo "dblock-v$1"; }
node_dir() { echo "$DIR/n$1"; }
clock_file() { echo "$(node_dir "$1")/clock-offset"; }
# The node's PostgreSQL binaries: $PGBIN, or for the clock node its wrappers.
bin_dir() { if [ "$1" = "$CLOCK_NODE" ]; then echo "$(node_dir "$1")/bin"; else echo "$PGBIN"; fi; }

# ---------------------------------------------------------------------------------------------
# Packages

cmd_install() {
    local missing=()
    command -v patroni >/dev/null || missing+=(patroni)
    command -v etcd >/dev/null || missing+=(etcd-server)
    command -v haproxy >/dev/null || missing+=(haproxy)
    command -v ip >/dev/null || missing+=(iproute2)
    command -v curl >/dev/null || missing+=(curl)
    [ -x "$PGBIN/postgres" ] || missing+=(postgresql-15)
    [ -f "$FAKETIME_LIB" ] || missing+=(faketime)
    if [ "${#missing[@]}" -eq 0 ]; then
        log "packages: all present"
        return
    fi
    log "packages: installing ${missing[*]}"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
}

# ---------------------------------------------------------------------------------------------
# The network: a bridge on the host, a namespace per node.

net_up() {
    ip link add "$BRIDGE" type bridge
    ip addr add "$HOST_IP/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local i
    for i in "${NODES[@]}"; do
        ip netns add "$(netns "$i")"
        ip link add "$(veth "$i")" type veth peer name eth0 netns "$(netns "$i")"
        ip link set "$(veth "$i")" master "$BRIDGE"
        ip link set "$(veth "$i")" up
        ip -n "$(netns "$i")" addr add "$(node_ip "$i")/24" dev eth0
        ip -n "$(netns "$i")" link set eth0 up
        ip -n "$(netns "$i")" link set lo up
    done
}

net_down() {
    local i
    for i in "${NODES[@]}"; do
        ip link del "$(veth "$i")" 2>/dev/null || true
        ip netns del "$(netns "$i")" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}

# ---------------------------------------------------------------------------------------------
# etcd, Patroni, HAProxy

# spawn <pid file> <log> <command...>: in the background, in a session of its own (a Ctrl-C
# meant for this script reaches its trap, not the server), its pid written down.
spawn() {
    local pidfile=$1 logfile=$2; shift 2
    (setsid bash -c 'echo $$ >"$0"; exec "$@"' "$pidfile" "$@" </dev/null >"$logfile" 2>&1 &) \
        </dev/null >/dev/null 2>&1
}

start_etcd() {
    install -d -m 0700 "$DIR/etcd"
    spawn "$DIR/etcd/pid" "$DIR/etcd/etcd.log" etcd --name dblock --data-dir "$DIR/etcd/data" \
        --listen-client-urls "http://$HOST_IP:$ETCD_PORT" \
        --advertise-client-urls "http://$HOST_IP:$ETCD_PORT" \
        --listen-peer-urls "http://$HOST_IP:$ETCD_PEER_PORT" \
        --initial-advertise-peer-urls "http://$HOST_IP:$ETCD_PEER_PORT" \
        --initial-cluster "dblock=http://$HOST_IP:$ETCD_PEER_PORT"
    wait_until 30 "etcd" curl -sf "http://$HOST_IP:$ETCD_PORT/health"
}

write_patroni_yml() { # write_patroni_yml <i> [synchronous_mode] [nosync tag]
    local i=$1 d ip sync=${2:-false} nosync=${3:-false}
    d=$(node_dir "$i")
    ip=$(node_ip "$i")
    cat >"$d/patroni.yml" <<EOF
scope: dblock
namespace: /dblock/
name: n$i
log:
  level: WARNING
restapi:
  listen: $ip:8008
  connect_address: $ip:8008
etcd3:
  host: $HOST_IP:$ETCD_PORT
bootstrap:
  dcs:
    ttl: $TTL
    loop_wait: $LOOP_WAIT
    retry_timeout: $RETRY_TIMEOUT
    maximum_lag_on_failover: 1048576
    synchronous_mode: $sync
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        wal_level: replica
        hot_standby: "on"
        max_connections: 100
        max_wal_senders: 10
        max_replication_slots: 10
        wal_log_hints: "on"
        wal_keep_size: 256MB
        # A leader whose network is cut stops (to demote) only once its walsenders give up
        # on their standbys: 5 s, not the default minute.
        wal_sender_timeout: 5s
        wal_receiver_timeout: 5s
  initdb:
  - encoding: UTF8
  - auth: trust
postgresql:
  listen: $ip:5432
  connect_address: $ip:5432
  data_dir: $d/data
  bin_dir: $(bin_dir "$i")
  pgpass: $d/pgpass
  authentication:
    superuser:
      username: postgres
    replication:
      username: postgres
    rewind:
      username: postgres
  parameters:
    unix_socket_directories: '$d'
  pg_hba:
  - local all all trust
  - host all all 0.0.0.0/0 trust
  - host replication all 0.0.0.0/0 trust
tags:
  nofailover: false
  noloadbalance: false
  clonefrom: false
  nosync: $nosync
EOF
    chown postgres:postgres "$d/patroni.yml"
}

# The clock node's bin_dir: every PostgreSQL binary a symlink, but `postgres` (which Patroni
# runs itself, `bin_dir/postgres -D ...`, and which `exec` keeps at the pid Patroni was given)
# runs under libfaketime; the offset file says `+0` until `clock` steps it.
write_clock_wrappers() {
    local i=$1 d f
    d=$(bin_dir "$i")
    install -d -o postgres -g postgres -m 0755 "$d"
    for f in "$PGBIN"/*; do
        [ "$(basename "$f")" = postgres ] || ln -s "$f" "$d/"
    done
    cat >"$d/postgres" <<EOF
#!/bin/sh
# PostgreSQL with a clock of its own (scripts/patroni.sh clock $i OFFSET).
exec env LD_PRELOAD=$FAKETIME_LIB FAKETIME_TIMESTAMP_FILE=$(clock_file "$i") \\
    FAKETIME_NO_CACHE=1 FAKETIME_DONT_FAKE_MONOTONIC=1 $PGBIN/postgres "\$@"
EOF
    chown postgres:postgres "$d/postgres"
    chmod 0755 "$d/postgres"
    echo +0 >"$(clock_file "$i")"
    chown postgres:postgres "$(clock_file "$i")"
    chmod 0644 "$(clock_file "$i")"
}

start_patroni() { # start_patroni <i>: in the node's namespace, as postgres, a session of its own
    local i=$1 d
    d=$(node_dir "$i")
    (cd / && ip netns exec "$(netns "$i")" runuser -u postgres -- \
        setsid patroni "$d/patroni.yml" </dev/null >>"$d/patroni.log" 2>&1 &) \
        </dev/null >/dev/null 2>&1
}

start_haproxy() {
    install -d -m 0755 "$DIR/haproxy"
    {
        cat <<EOF
global
    maxconn 1000
defaults
    mode tcp
    retries 2
    timeout client 30m
    timeout connect 2s
    timeout server 30m
    timeout check 1s
listen primary
    bind 127.0.0.1:$HAPROXY_PORT
    option httpchk OPTIONS /primary
    http-check expect status 200
    default-server inter 500ms fall 2 rise 2 on-marked-down shutdown-sessions
EOF
        local i
        for i in "${NODES[@]}"; do
            echo "    server n$i $(node_ip "$i"):5432 maxconn 300 check port 8008"
        done
    } >"$DIR/haproxy/haproxy.cfg"
    spawn "$DIR/haproxy/pid" "$DIR/haproxy/haproxy.log" haproxy -f "$DIR/haproxy/haproxy.cfg"
}

ctl() { patronictl -c "$(node_dir 1)/patroni.yml" "$@"; }

# The leader's node number, as etcd (through any node's view: patronictl) says; empty if none.
leader() {
    ctl list -f json 2>/dev/null |
        python3 -c 'import json,sys; print(next((m["Member"][1:] for m in json.load(sys.stdin) if m["Role"] == "Leader"), ""))' 2>/dev/null ||
        true
}

# psql through HAProxy (to the leader), or to node i directly.
psql_haproxy() { "$PGBIN/psql" -X -q -h 127.0.0.1 -p "$HAPROXY_PORT" -U postgres -d postgres -tAc "$1"; }
psql_node() { "$PGBIN/psql" -X -q -h "$(node_ip "$1")" -p 5432 -U postgres -d postgres -tAc "$2"; }

# HAProxy reaches a primary that is not in recovery: `false`.
haproxy_writable() { [ "$(psql_haproxy "SELECT pg_is_in_recovery()" 2>/dev/null)" = f ]; }

haproxy_settled() {
    local _
    for _ in 1 2 3 4 5 6; do haproxy_writable || return 1; done
}

# Every node is running and, but the leader, streaming from it; in sync mode one of them is
# the synchronous standby.
replicas_streaming() {
    local l want n
    l=$(leader)
    [ -n "$l" ] || return 1
    want=$((${#NODES[@]} - 1))
    n=$(psql_node "$l" "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'" 2>/dev/null) || return 1
    [ "$n" = "$want" ] || return 1
    if [ "$(ctl show-config 2>/dev/null | awk '/^synchronous_mode:/ {print $2}')" = true ]; then
        [ "$(psql_node "$l" "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'" 2>/dev/null)" = 1 ] || return 1
        # And in etcd's /sync key, which a switchover requires (Patroni writes it once the
        # standby caught up, after PostgreSQL's `sync`).
        [ "$(cluster_roles | grep -c ' sync_standby$')" = 1 ] || return 1
    fi
}

cmd_wait_replicas() {
    local t0
    t0=$(now_ms)
    wait_until "$READY_TIMEOUT" "every replica streaming" replicas_streaming
    echo "replicas_ms=$(($(now_ms) - t0))"
}

# `up` as a command: a failed start leaves nothing running (unless DBLOCK_PATRONI_KEEP=1, to
# look at the logs).
cmd_up() {
    trap 'log "up failed: tearing down (DBLOCK_PATRONI_KEEP=1 keeps it)"; [ "${DBLOCK_PATRONI_KEEP:-}" = 1 ] || cmd_down' EXIT
    bring_up
    trap - EXIT
}

bring_up() {
    local t0 i
    t0=$(now_ms)
    cmd_down_quiet
    install -d -m 0755 "$DIR"
    (cd / && runuser -u postgres -- test -x "$DIR") ||
        die "the postgres user cannot enter $DIR: set DBLOCK_PATRONI_DIR outside it"
    net_up
    start_etcd
    for i in "${NODES[@]}"; do
        install -d -o postgres -g postgres -m 0700 "$(node_dir "$i")"
        [ "$i" != "$CLOCK_NODE" ] || write_clock_wrappers "$i"
        write_patroni_yml "$i"
    done
    log "Patroni: n1 bootstraps"
    start_patroni 1
    wait_until "$READY_TIMEOUT" "n1 leading" sh -c "[ \"\$('$SELF' leader)\" = 1 ]"
    for i in 2 3; do start_patroni "$i"; done
    wait_until "$READY_TIMEOUT" "two replicas streaming" replicas_streaming
    # HAProxy takes every server for up until its checks say otherwise: it is ready when the
    # leader is the only one it sends to (several connections in a row reach a writable server).
    start_haproxy
    wait_until "$READY_TIMEOUT" "HAProxy to the leader alone" haproxy_settled
    psql_haproxy "CREATE DATABASE test" >/dev/null
    touch "$DIR/up"
    log "Patroni: up (leader n$(leader))"
    echo "patroni_up_ms=$(($(now_ms) - t0))"
}

cmd_mode() {
    local mode=${1:?sync or async} value
    case $mode in sync) value=true ;; async) value=false ;; *) die "mode: sync or async" ;; esac
    ctl edit-config --force --set "synchronous_mode=$value" >/dev/null
    if [ "$value" = true ]; then
        wait_until 60 "a synchronous standby" sh -c \
            "[ \"\$('$PGBIN/psql' -X -q -h 127.0.0.1 -p $HAPROXY_PORT -U postgres -d postgres -tAc \"SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'\")\" = 1 ]"
    else
        wait_until 60 "no synchronous standby" sh -c \
            "[ \"\$('$PGBIN/psql' -X -q -h 127.0.0.1 -p $HAPROXY_PORT -U postgres -d postgres -tAc \"SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'\")\" = 0 ]"
    fi
    log "Patroni: synchronous_mode=$value"
    echo "mode=$mode"
}

# Waits for a leader other than node $1 behind HAProxy; prints when (ms since $2).
wait_new_leader() {
    local old=$1 t0=$2
    wait_until 90 "a new leader" sh -c "l=\$('$SELF' leader); [ -n \"\$l\" ] && [ \"\$l\" != $old ]"
    echo "new_leader=$(leader)"
    echo "new_leader_ms=$(($(now_ms) - t0))"
    wait_until 90 "HAProxy to the new leader" haproxy_settled
    echo "haproxy_writable_ms=$(($(now_ms) - t0))"
}

cmd_switchover() {
    local old t0 out
    old=$(leader)
    [ -n "$old" ] || die "no leader"
    t0=$(now_ms)
    # No candidate named: Patroni picks one (in synchronous mode, it must be the synchronous
    # standby).
    log "Patroni: switchover from n$old"
    echo "old_leader=$old"
    # patronictl says why it refused a switchover, but exits 0: fail at once rather than wait
    # 90 s for a leader that is not coming.
    out=$(ctl switchover --leader "n$old" --force 2>&1) || true
    printf '%s\n' "$out" >&2
    ! grep -q "Switchover failed" <<<"$out" || die "switchover from n$old refused"
    wait_new_leader "$old" "$t0"
}

# Patroni's view of the cluster, from the REST API of the first node that answers (quicker
# than patronictl): one `name role` line per member (role leader, sync_standby, replica...).
cluster_roles() {
    local i
    for i in "${NODES[@]}"; do
        curl -sf --max-time 1 "http://$(node_ip "$i"):8008/cluster" |
            python3 -c 'import json,sys; [print(m["name"], m["role"]) for m in json.load(sys.stdin)["members"]]' &&
            return 0
    done
    return 1
}

synchronous_mode() { [ "$(ctl show-config 2>/dev/null | awk '/^synchronous_mode:/ {print $2}')" = true ]; }

# Node $1 streams from the leader and, with $2 = true (synchronous mode), is the synchronous
# standby, both in etcd's /sync key (which a switchover to it requires) and on the leader.
streams_as_candidate() {
    local n=$1 sync=$2 roles l
    roles=$(cluster_roles) || return 1
    l=$(awk '$2 == "leader" {print substr($1, 2)}' <<<"$roles")
    [ -n "$l" ] && [ "$l" != "$n" ] || return 1
    [ "$(psql_node "$l" "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'n$n' AND state = 'streaming'" 2>/dev/null)" != "" ] || return 1
    if [ "$sync" = true ]; then
        grep -qx "n$n sync_standby" <<<"$roles" || return 1
        [ "$(psql_node "$l" "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'n$n'" 2>/dev/null)" = sync ] || return 1
    fi
}

# The same for a second in a row (a replica whose clock was just stepped ahead drops its
# stream once: its walreceiver's wal_receiver_timeout runs on its own time of day).
candidate_settled() {
    local _
    for _ in 1 2 3 4 5; do streams_as_candidate "$1" "$2" || return 1; sleep 0.25; done
}

# `tag_nosync <true|false> <nodes...>`: their `nosync` tag, in patroni.yml, reloaded.
tag_nosync() {
    local value=$1 i
    shift
    for i in "$@"; do
        # (synchronous_mode there is bootstrap-only: what the cluster runs is etcd's.)
        write_patroni_yml "$i" true "$value"
        ctl reload dblock "n$i" --force >/dev/null
    done
}

# The nodes `switchover-to` tagged nosync, untagged again when it ends (whichever way).
NOSYNC_TAGGED=()
untag_nosync() {
    [ "${#NOSYNC_TAGGED[@]}" -eq 0 ] || tag_nosync false "${NOSYNC_TAGGED[@]}"
    NOSYNC_TAGGED=()
}

cmd_switchover_to() {
    local n=${1:?node number} old t0 others=() i t_prep sync=false out
    old=$(leader)
    [ -n "$old" ] || die "no leader"
    [ "$old" != "$n" ] || die "n$n leads already"
    echo "old_leader=$old"
    t_prep=$(now_ms)
    # In synchronous mode Patroni switches over to the synchronous standby only: the other
    # replica is tagged nosync until n$n is that standby (the leader picks it within a loop).
    if synchronous_mode; then
        sync=true
        for i in "${NODES[@]}"; do [ "$i" = "$old" ] || [ "$i" = "$n" ] || others+=("$i"); done
        NOSYNC_TAGGED=("${others[@]}")
        trap untag_nosync EXIT
        tag_nosync true "${others[@]}"
    fi
    wait_until 60 "n$n streaming (and the synchronous standby)" candidate_settled "$n" "$sync"
    echo "candidate_ready_ms=$(($(now_ms) - t_prep))"
    t0=$(now_ms)
    echo "switchover_at_ms=$t0"
    log "Patroni: switchover from n$old to n$n"
    # patronictl says why it refused a switchover, but exits 0.
    out=$(ctl switchover --leader "n$old" --candidate "n$n" --force 2>&1) || true
    printf '%s\n' "$out" >&2
    ! grep -q "Switchover failed" <<<"$out" || die "switchover to n$n refused"
    wait_new_leader "$old" "$t0"
    [ "$(leader)" = "$n" ] || die "the new leader is n$(leader), not n$n"
    untag_nosync
    trap - EXIT
}

# clock N OFFSET: node N's PostgreSQL time of day is the real one plus OFFSET from now on.
cmd_clock() {
    local i=${1:?node number} offset=${2:?offset, e.g. +60s or +0}
    [ "$i" = "$CLOCK_NODE" ] || die "clock: only node $CLOCK_NODE runs under libfaketime"
    [[ $offset =~ ^[+-][0-9]+[smhd]?$ ]] || die "clock: an offset like +60s, -10s or +0"
    # Rewritten in place (owner and mode kept); every call of the server reads it.
    printf '%s\n' "$offset" >"$(clock_file "$i")"
    log "Patroni: n$i's PostgreSQL clock at real time $offset"
    echo "clock_n$i=$offset"
}

cmd_kill_leader() {
    local old pids t0
    old=$(leader)
    [ -n "$old" ] || die "no leader"
    pids=$(ip netns pids "$(netns "$old")")
    [ -n "$pids" ] || die "nothing runs in node $old's namespace"
    t0=$(now_ms)
    # shellcheck disable=SC2086
    kill -9 $pids
    log "Patroni: kill -9 Patroni and PostgreSQL of the leader n$old"
    echo "old_leader=$old"
    wait_new_leader "$old" "$t0"
}

cmd_cut_leader() {
    local old t0
    old=$(leader)
    [ -n "$old" ] || die "no leader"
    t0=$(now_ms)
    ip link set "$(veth "$old")" down
    log "Patroni: the leader n$old's link is down"
    echo "old_leader=$old"
    wait_new_leader "$old" "$t0"
    # Its own Patroni demotes it once it cannot renew the leader key (it keeps running, read-only).
    wait_until 60 "n$old demoted" sh -c \
        "[ \"\$(ip netns exec $(netns "$old") '$PGBIN/psql' -X -q -h $(node_ip "$old") -U postgres -d postgres -tAc 'SELECT pg_is_in_recovery()' 2>/dev/null)\" = t ]" || true
    echo "demoted_ms=$(($(now_ms) - t0))"
}

cmd_heal() {
    local i=${1:?node number}
    ip link set "$(veth "$i")" up
    log "Patroni: n$i's link is up again"
}

cmd_start_node() {
    local i=${1:?node number}
    [ -z "$(ip netns pids "$(netns "$i")")" ] || die "node $i is running"
    start_patroni "$i"
    log "Patroni: n$i started again"
}

cmd_env() {
    [ -f "$DIR/up" ] || die "not up (scripts/patroni.sh up)"
    echo "export DBLOCK_PATRONI_URL=postgres://postgres@127.0.0.1:$HAPROXY_PORT/test"
    echo "export DBLOCK_PATRONI_CTL=$SELF"
}

cmd_status() { ctl list; }

cmd_down_quiet() {
    local i pid
    for i in "${NODES[@]}"; do
        if ip netns list 2>/dev/null | grep -qw "$(netns "$i")"; then
            for pid in $(ip netns pids "$(netns "$i")"); do kill -9 "$pid" 2>/dev/null || true; done
        fi
    done
    for f in "$DIR/haproxy/pid" "$DIR/etcd/pid"; do
        if [ -s "$f" ]; then
            pid=$(tr -dc '0-9' <"$f")
            # Only a process of ours: its command line names our directory.
            if [ -n "$pid" ] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "$DIR/"; then
                kill -9 "$pid" 2>/dev/null || true
            fi
        fi
    done
    sleep 0.3
    net_down
    rm -rf "$DIR"
}

cmd_down() {
    cmd_down_quiet
    log "down: done"
}

# The whole thing, torn down whatever happens.
cmd_test() {
    local modes=${1:-both} t0 t1 t2
    [ $# -gt 0 ] && shift
    case $modes in sync | async) ;; both) modes="sync async" ;; *) die "test: sync, async or both" ;; esac
    t0=$(now_ms)
    cmd_install
    log "building the test"
    (cd "$REPO" && cargo test --workspace --all-features --test replicated --no-run)
    t1=$(now_ms)
    trap 'cmd_down' EXIT
    trap 'exit 130' INT TERM
    bring_up
    eval "$(cmd_env)"
    t2=$(now_ms)
    local mode
    for mode in $modes; do
        log "chaos run, synchronous_mode: $mode"
        cmd_mode "$mode" >/dev/null
        (cd "$REPO" && DBLOCK_REQUIRE_REPLICATED=1 DBLOCK_PATRONI_MODE=$mode \
            cargo test --workspace --all-features --test replicated -- --nocapture \
            --test-threads=1 --exact patroni_failover patroni_failover_fenced_writes_and_steals \
            patroni_failover_to_a_clock_ahead "$@")
    done
    cmd_down
    trap - EXIT
    echo "build_ms=$((t1 - t0)) up_ms=$((t2 - t1)) test_ms=$(($(now_ms) - t2)) total_ms=$(($(now_ms) - t0))"
}

[ "$(id -u)" = 0 ] || die "run as root (namespaces; the servers run as the postgres user)"
command=${1:-}
[ $# -gt 0 ] && shift
case $command in
install) cmd_install ;;
up) cmd_up ;;
down) cmd_down ;;
env) cmd_env ;;
status) cmd_status ;;
mode) cmd_mode "$@" ;;
leader) leader ;;
switchover) cmd_switchover ;;
switchover-to) cmd_switchover_to "$@" ;;
clock) cmd_clock "$@" ;;
kill-leader) cmd_kill_leader ;;
cut-leader) cmd_cut_leader ;;
heal) cmd_heal "$@" ;;
start-node) cmd_start_node "$@" ;;
wait-replicas) cmd_wait_replicas ;;
test) cmd_test "$@" ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
