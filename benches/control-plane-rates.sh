#!/usr/bin/env bash
# Control-plane traffic of a running fleet: NATS messages/s per prefill instance and etcd
# requests/s, at idle and under load. Starts etcd, NATS (with monitoring), a scheduler, two
# prefill instances (mock engine) and a frontend on free loopback ports, samples the
# servers' own counters for SECONDS at idle and SECONDS under load, prints a table, stops all.
# Usage: benches/control-plane-rates.sh [SECONDS]   (needs a release build of handoff)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
bin=target/release/handoff
client=target/release/generate_client
tmp=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ec=$(port); ep=$(port); np=$(port); nm=$(port); fp=$(port)
etcd --data-dir "$tmp/etcd" --listen-client-urls "http://127.0.0.1:$ec" --advertise-client-urls "http://127.0.0.1:$ec" \
    --listen-peer-urls "http://127.0.0.1:$ep" --initial-advertise-peer-urls "http://127.0.0.1:$ep" \
    --initial-cluster "default=http://127.0.0.1:$ep" >"$tmp/etcd.log" 2>&1 & pids+=($!)
nats-server -a 127.0.0.1 -p "$np" -m "$nm" >"$tmp/nats.log" 2>&1 & pids+=($!)
sleep 2
export HANDOFF_ETCD="http://127.0.0.1:$ec" HANDOFF_NATS="nats://127.0.0.1:$np" RUST_LOG=warn
$bin scheduler --listen 127.0.0.1:0 >/dev/null & pids+=($!)
$bin prefill --engine mock --id p0 --bootstrap-listen 127.0.0.1:0 --grpc-listen 127.0.0.1:0 >/dev/null & pids+=($!)
$bin prefill --engine mock --id p1 --bootstrap-listen 127.0.0.1:0 --grpc-listen 127.0.0.1:0 >/dev/null & pids+=($!)
$bin frontend --engine mock --listen "127.0.0.1:$fp" --http-listen 127.0.0.1:0 >/dev/null & pids+=($!)
sleep 4
nats_in() { curl -s "http://127.0.0.1:$nm/varz" | python3 -c 'import json,sys; print(json.load(sys.stdin)["in_msgs"])'; }
etcd_reqs() { curl -s "http://127.0.0.1:$ec/metrics" | awk '/^grpc_server_msg_received_total/ {s+=$2} END {print s+0}'; }
measure() {
    local n0 e0 n1 e1
    n0=$(nats_in); e0=$(etcd_reqs); sleep "$secs"; n1=$(nats_in); e1=$(etcd_reqs)
    python3 -c "print(f'| $1 | {($n1-$n0)/$secs/2:.1f} | {($e1-$e0)/$secs:.2f} |')"
}
echo "| phase | NATS msgs/s per prefill instance | etcd requests/s (whole fleet, 4 processes) |"
echo "|---|---:|---:|"
measure idle
( end=$((SECONDS+secs+1)); i=0; while [ $SECONDS -lt $end ]; do $client "http://127.0.0.1:$fp" "request $i: a prompt long enough to fill a few pages of the prefix cache, so that every request stores blocks and publishes KV events like real traffic does, over and over again" >/dev/null; i=$((i+1)); done; echo "$i" >"$tmp/count" ) &
measure "load (sequential requests)"
wait $! 2>/dev/null || true
echo "requests during load: $(cat "$tmp/count" 2>/dev/null || echo ?)"
