#!/usr/bin/env bash
# Where a lock cycle's time goes on PostgreSQL: runs `benches/profile.rs` once (its environment
# says what: DBLOCK_PROFILE, DBLOCK_PROFILE_OWNERS, DBLOCK_PROFILE_CYCLES, ...) and prints, per
# cycle, the CPU of the client process, of every PostgreSQL process (backends, and the exited
# ones through the postmaster's children's time), of the rest of the machine, the machine's idle
# share, and the transactions the database committed (one per statement). The README's
# "Where the time goes" tables are made with it.
#
#   cargo bench -p dblock-bench --bench profile --no-run
#   DBLOCK_PROFILE_OWNERS=64 DBLOCK_PROFILE_CYCLES=800 scripts/cycle-cost.sh
#   DBLOCK_PROFILE=ceiling DBLOCK_PROFILE_OWNERS=64 DBLOCK_PROFILE_CYCLES=800 scripts/cycle-cost.sh
#
# The benchmark's table is `dblock_profile` in $DBLOCK_PG_URL (default
# postgres://postgres@127.0.0.1:5432/test); it is vacuumed first, as the benchmark does its own.
# Run it on an otherwise idle machine: "the rest" and the statements count whatever else runs
# (the statements, anything on that database). Needs psql, python3 and GNU time; Linux only.
set -euo pipefail
cd "$(dirname "$0")/.."
url=${DBLOCK_PG_URL:-postgres://postgres@127.0.0.1:5432/test}
bin=$(ls -t target/release/deps/profile-* 2>/dev/null | grep -v '\.d$' | head -n1 || true)
if [ -z "$bin" ]; then
    echo "build it first: cargo bench -p dblock-bench --bench profile --no-run" >&2
    exit 1
fi

# Ticks of every PostgreSQL process: user + system, its own and its exited children's.
pg_ticks() {
    local total=0 pid stat rest
    for pid in /proc/[0-9]*; do
        stat=$(cat "$pid/stat" 2>/dev/null) || continue
        case "$stat" in *"(postgres)"* | *"(postmaster)"*) ;; *) continue ;; esac
        rest=${stat##*) }
        # Fields after the command: utime, stime, cutime, cstime are the 12th to 15th.
        read -r -a f <<<"$rest"
        total=$((total + f[11] + f[12] + f[13] + f[14]))
    done
    echo "$total"
}
# Busy and idle ticks of the whole machine.
machine_ticks() { awk '/^cpu / { print $2+$3+$4+$5+$6+$7+$8+$9, $5+$6 }' /proc/stat; }
commits() {
    psql "$url" -Atc "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
}

psql "$url" -qc "VACUUM dblock_profile" 2>/dev/null || true
read -r all0 idle0 < <(machine_ticks)
pg0=$(pg_ticks)
tx0=$(commits)
out=$( { /usr/bin/time -f "client-seconds %U %S" "$bin" "$url"; } 2>&1 )
read -r all1 idle1 < <(machine_ticks)
pg1=$(pg_ticks)
sleep 0.6 # the statistics collector's report interval
tx1=$(commits)
echo "$out" | grep -v '^client-seconds'
python3 - "$out" "$all0" "$idle0" "$all1" "$idle1" "$pg0" "$pg1" "$tx0" "$tx1" "$(getconf CLK_TCK)" <<'PY'
import re, sys
out = sys.argv[1]
all0, idle0, all1, idle1, pg0, pg1, tx0, tx1, hz = map(int, sys.argv[2:])
cycles = int(re.search(r"(\d+) cycles in", out).group(1))
user, system = map(float, re.search(r"client-seconds ([\d.]+) ([\d.]+)", out).groups())
client = user + system
total, idle = (all1 - all0) / hz, (idle1 - idle0) / hz
server = (pg1 - pg0) / hz
us = lambda s: s * 1e6 / cycles
print(f"per cycle: client {us(client):.1f} us ({us(system):.1f} of it in the kernel), "
      f"PostgreSQL {us(server):.1f} us, the rest {us(total - idle - client - server):.1f} us; "
      f"machine idle {100 * idle / total:.0f} %; statements {(tx1 - tx0) / cycles:.3f}")
PY
