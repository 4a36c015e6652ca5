"""vLLM 0.33's own NIXL prefill side, pull mode (vLLM's default: the decode READs), over a
real NIXL agent (the nixl-cu13 wheel, UCX over TCP) holding a DRAM "KV cache". The vLLM code
is the wheel's, unmodified, loaded by vllm_shim.py: NixlAgentMetadata and NixlHandshakePayload
encoded as base_worker.py does, the side channel (_nixl_handshake_listener) started by
set_xfer_handshake_metadata, and _get_new_notifs, which frees a request's blocks once every
consumer has sent its "<request id>:<consumers>" notification.

The cache: LAYERS regions (vLLM 0.33 registers one per attention layer, K and V packed),
NUM_BLOCKS blocks of BLOCK_LEN bytes, STRIDE bytes apart, random bytes.

argv: PORT. First line: {"engine_id", "regions", "num_blocks", "block_len", "block_size"}.
stdin, one JSON object per line:
  {"cmd": "send", "req": ID, "blocks": [...]}  -> the request's blocks wait for their reader;
      prints {"req": ID, "sha256": [hex of each region's block, region-major]}
  {"cmd": "quit"}
Prints {"freed": [ID, ...]} when vLLM's code frees requests.
"""
import hashlib
import json
import os
import select
import sys
import time
import uuid

import numpy as np
from nixl_cu13._api import nixl_agent, nixl_agent_config

sys.path.insert(0, os.path.dirname(__file__))
import vllm_shim  # noqa: E402  (loads vLLM's code with its stand-ins)

LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, ELEM = 4, 64, 16, 3, 64, 4
BLOCK_LEN = HEADS * BLOCK_SIZE * 2 * HEAD_DIM * ELEM
# Blocks twice their length apart, so a reader that steps by the length reads wrong blocks.
STRIDE = 2 * BLOCK_LEN


def main():
    port = int(sys.argv[1])
    # As vLLM's worker makes its agent (base_worker.py).
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(num_threads=4, backends=["UCX"]))
    rng = np.random.default_rng(7)
    regions = [rng.integers(0, 256, NUM_BLOCKS * STRIDE, dtype=np.uint8) for _ in range(LAYERS)]
    descs = agent.get_reg_descs([(r.ctypes.data, r.nbytes, 0, "") for r in regions], "DRAM")
    agent.register_memory(descs)
    engine_id = str(uuid.uuid4())
    payload = vllm_shim.payload(
        agent, engine_id, [(r.ctypes.data, r.nbytes) for r in regions], NUM_BLOCKS, BLOCK_LEN,
        STRIDE, BLOCK_SIZE, "LBHNC",
    )
    stop = vllm_shim.side_channel({(0, 0): payload}, port)
    # No decode here heartbeats (the reads under test are quick), and none is expired.
    worker, poll = vllm_shim.worker(agent, lambda ids: None)
    print(json.dumps({"engine_id": engine_id, "regions": len(regions), "num_blocks": NUM_BLOCKS,
                      "block_len": BLOCK_LEN, "block_size": BLOCK_SIZE}), flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.01)
        if ready:
            line = sys.stdin.readline()
            if not line:
                break
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "send":
                req = cmd["req"]
                worker._reqs_to_send[req] = time.perf_counter() + 30
                worker._reqs_to_process.add(req)
                sums = [
                    hashlib.sha256(r[b * STRIDE:b * STRIDE + BLOCK_LEN].tobytes()).hexdigest()
                    for r in regions for b in cmd["blocks"]
                ]
                print(json.dumps({"req": req, "sha256": sums}), flush=True)
        freed = poll()
        if freed:
            print(json.dumps({"freed": sorted(freed)}), flush=True)
    stop.set()


if __name__ == "__main__":
    main()
