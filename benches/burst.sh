#!/usr/bin/env bash
# A burst on `handoff up` with the real model, as a new user would send it: N concurrent
# /v1/chat/completions requests of 8 tokens each (default 300), then one more right after.
# Prints how many were answered (200), refused (429, with their latency), and anything else
# (which should be nothing), and the latency of a request before and right after the burst.
# Usage: benches/burst.sh [N] [extra `handoff up` flags]   (needs a release build of handoff
# and the model: scripts/fetch-model)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-300}
shift || true
bin=target/release/handoff
tmp=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
hp=$(port)
RUST_LOG=${RUST_LOG:-warn} $bin up --model "$(scripts/fetch-model)" --frontend-listen 127.0.0.1:0 \
    --http-listen "127.0.0.1:$hp" --scheduler-listen 127.0.0.1:0 --bootstrap-port 0 \
    --prefill-port 0 "$@" >"$tmp/up.log" 2>&1 & pids+=($!)
for _ in $(seq 1 300); do grep -qs "handoff ready" "$tmp/up.log" && break; sleep 0.2; done
grep -q "handoff ready" "$tmp/up.log" || { cat "$tmp/up.log"; exit 1; }
ask() { # $1: tag, $2: question
    curl -s -o "$tmp/body.$1" -w "%{http_code} %{time_total}\n" "http://127.0.0.1:$hp/v1/chat/completions" \
        -H 'content-type: application/json' \
        -d "{\"model\": \"SmolLM2-135M-Instruct\", \"max_tokens\": 8, \"messages\": [{\"role\": \"user\", \"content\": \"$2\"}]}"
}
before=$(ask before "What is the capital of France?")
# One curl process sends the whole burst at once (300 curl processes would spend the
# cores the server needs, and time their own start-up).
for i in $(seq 1 "$n"); do
    printf 'next\nurl = "http://127.0.0.1:%s/v1/chat/completions"\nheader = "content-type: application/json"\n' "$hp"
    printf 'data = "{\\"model\\": \\"SmolLM2-135M-Instruct\\", \\"max_tokens\\": 8, \\"messages\\": [{\\"role\\": \\"user\\", \\"content\\": \\"Question number %s: what is %s times %s?\\"}]}"\n' "$i" "$i" "$i"
    printf 'output = "%s/body.b%s"\nwrite-out = "%%{http_code} %%{time_total} %s/body.b%s\\n"\n' "$tmp" "$i" "$tmp" "$i"
done | tail -n +2 >"$tmp/burst.cfg"
started=$SECONDS
curl -s --no-progress-meter --parallel --parallel-immediate --parallel-max "$n" -K "$tmp/burst.cfg" >"$tmp/rows" || true
after=$(ask after "What is the capital of Italy?")
took=$((SECONDS - started))
python3 -c "
import sys, collections, json, re
rows = [l.split() for l in open('$tmp/rows') if l.strip()]
why = collections.Counter(); raw = []
for code, t, body in rows:
    if code != '200':
        try: msg = json.load(open(body))['error']['message']
        except Exception: msg = open(body).read()[:200]
        why[(code, re.sub(r'[0-9]+', 'N', msg)[:160])] += 1; raw.append((float(t), msg))
rows = [r[:2] for r in rows]
by = collections.defaultdict(list)
for code, t in rows: by[code].append(float(t) * 1000)
def pct(v, p): v = sorted(v); return v[min(len(v) - 1, round((len(v) - 1) * p))] if v else 0
print(f'burst of {len(rows)} chat requests (8 tokens each), done in about $took s:')
print('| status | count | p50 ms | p99 ms | max ms |')
print('|---|---:|---:|---:|---:|')
for code in sorted(by):
    v = by[code]
    print(f'| {code} | {len(v)} | {pct(v, .5):.0f} | {pct(v, .99):.0f} | {max(v):.0f} |')
b, a = '$before'.split(), '$after'.split()
for (code, msg), k in why.most_common(5): print(f'{k} x {code}: {msg}')
for t, m in sorted(raw)[::max(1, len(raw) // 4)]: print(f'{t:.1f}s {m[:230]}')
print(f'before the burst: {b[0]} in {float(b[1]) * 1000:.0f} ms; right after: {a[0]} in {float(a[1]) * 1000:.0f} ms')
"
