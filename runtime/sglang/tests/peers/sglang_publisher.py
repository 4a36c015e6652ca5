"""SGLang 0.5.23's own KV event publisher (`ZmqEventPublisher` from
sglang/srt/disaggregation/kv_events.py, unmodified; stubs in sgl_shim.py), one per dp rank.

argv: PORT REPLAY_PORT DP. dp rank r publishes on tcp://*:PORT+r with its replay ROUTER on
tcp://*:REPLAY_PORT+r, topic "kv". Reads JSON commands from stdin, one per line, and
publishes each as a KVEventBatch of one event on its dp rank:
  {"dp": 1, "stored": {"hashes": [...], "parent": null, "tokens": [...], "block_size": 1}}
  {"dp": 1, "removed": [...]}        {"dp": 1, "cleared": true}
Prints "ready" once the publishers are up and "ok" after each command; a port in use is
reported as {"port_taken": true} and exit 75 (event_commands.start)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import event_commands  # noqa: E402
import sgl_shim  # noqa: E402  (before any sglang import)

from sglang.srt.disaggregation.kv_events import (  # noqa: E402
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher,
)

port, replay, dp = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
publishers = event_commands.start(lambda: [
    ZmqEventPublisher(attn_dp_rank=r, endpoint=f"tcp://*:{port}",
                      replay_endpoint=f"tcp://*:{replay}", topic="kv")
    for r in range(dp)
])
event_commands.serve(
    publishers,
    stored=lambda s: BlockStored(block_hashes=s["hashes"], parent_block_hash=s.get("parent"),
                                 token_ids=s["tokens"], block_size=s["block_size"],
                                 lora_id=None, medium="GPU"),
    removed=lambda hashes: BlockRemoved(block_hashes=hashes, medium="GPU"),
    cleared=AllBlocksCleared,
    batch=lambda events: KVEventBatch(ts=time.time(), events=events),
)
