"""The command loop both engine publishers run (sglang_publisher.py, vllm_publisher.py):
one publisher per dp rank, JSON commands on stdin, each published as a KVEventBatch of one
event on its dp rank, "ready" once up and "ok" after each command."""
import json
import sys
import time


def serve(publishers, stored, removed, cleared, batch):
    """`stored(s)`, `removed(hashes)`, `cleared()` make events; `batch(events)` a batch."""
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "stored" in cmd:
            ev = stored(cmd["stored"])
        elif "removed" in cmd:
            ev = removed(cmd["removed"])
        else:
            ev = cleared()
        publishers[cmd["dp"]].publish(batch([ev]))
        time.sleep(0.05)  # its publisher thread sends it
        print("ok", flush=True)
    for p in publishers:
        p.shutdown()
