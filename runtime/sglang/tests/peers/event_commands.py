"""The command loop both engine publishers run (sglang_publisher.py, vllm_publisher.py):
one publisher per dp rank, JSON commands on stdin, each published as a KVEventBatch of one
event on its dp rank, "ready" once up and "ok" after each command; a port in use when the
publishers bind is reported as {"port_taken": true} instead of "ready"."""
import errno
import json
import sys
import time

import zmq

# How a publisher that could not bind a port (another process holds it: taken after the test
# picked it, or a dp rank's port + r that no pick checked) exits; the test picks other ports.
PORT_TAKEN = 75


def start(build):
    """The publishers `build()` makes. A bind refused because the address is in use prints
    {"port_taken": true} and exits PORT_TAKEN; any other failure goes up (exit 1, the reason
    on stderr)."""
    try:
        return build()
    except zmq.error.ZMQError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        print(json.dumps({"port_taken": True}), flush=True)
        sys.exit(PORT_TAKEN)


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
