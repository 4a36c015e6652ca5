"""A MOCK vLLM prefill server, for tests: vLLM 0.33's own NIXL connector code (the side
channel, the agent metadata encoding, the notification-driven freeing; vllm_shim.py loads it
from the wheel) over real NIXL agents, one per tensor-parallel rank, each holding a DRAM KV
cache. What vLLM's engine adds is played by this script: there is no forward pass (no torch),
the KV of each prompt it serves was computed beforehand by handoff's engine and is named in
SPEC, and a prompt it was not given is refused with 400.

argv: HTTP_PORT SIDE_PORT SPEC. SPEC is a JSON file: the model's shape (layers, kv_heads,
head_bytes), the cache (block_size, num_blocks, layout "LBHNC" or "LBNHC": vLLM 0.33 sends
its KVCacheLayout's name; tp), and prompts,
each {input_ids, kv_file[, answer]}: kv_file holds the prompt's KV in handoff's canonical
layout, [layer][k|v][head][token][head_bytes]; answer, fields that replace those of the
kv_transfer_params answered (a lying prefill the decode must refuse).

The cache, as vLLM 0.33 lays it out: one NIXL region per layer and rank, blocks of
block_size tokens, each token's head holding [K | V]; in a block, LBHNC (alias HND) is
[head][token][K|V] and LBNHC (alias NHD) [token][head][K|V]. Rank t of tp holds heads [t*H/tp, (t+1)*H/tp).

Serves, as vLLM's OpenAI server does with its NixlConnector (kv_role kv_both):
- POST /v1/completions with prompt (token ids) and kv_transfer_params {do_remote_decode:
  true}: takes free blocks (in scrambled order), writes the prompt's KV there on every rank,
  puts the request in each rank's _reqs_to_send (vLLM's lease, 30 s), and answers with the
  kv_transfer_params vLLM's request_finished gives (remote_request_id derived from the
  X-Request-Id header as vLLM's is: cmpl-<id>-0-<8 hex>); 503 when the cache is full;
- GET /health; GET /stats: {"held": request ids whose blocks are held, "freed": ids freed so
  far, "free_blocks": n, "heartbeats": per rank, the ids of each decode heartbeat it handled}.
Prints one JSON line when ready: {"http": port, "side": port}.
"""
import json
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from nixl_cu13._api import nixl_agent, nixl_agent_config

sys.path.insert(0, os.path.dirname(__file__))
import vllm_shim  # noqa: E402  (loads vLLM's code with its stand-ins)

http_port, side_port = int(sys.argv[1]), int(sys.argv[2])
spec = json.load(open(sys.argv[3]))
LAYERS, HEADS, HEAD_BYTES = spec["layers"], spec["kv_heads"], spec["head_bytes"]
BLOCK_SIZE, NUM_BLOCKS, LAYOUT, TP = (spec[k] for k in ("block_size", "num_blocks", "layout", "tp"))
assert HEADS % TP == 0, "each tp rank holds whole heads"
RANK_HEADS = HEADS // TP
BLOCK_LEN = RANK_HEADS * BLOCK_SIZE * 2 * HEAD_BYTES
PROMPTS = {}
for p in spec["prompts"]:
    n = len(p["input_ids"])
    kv = np.fromfile(p["kv_file"], dtype=np.uint8).reshape(LAYERS, 2, HEADS, n, HEAD_BYTES)
    PROMPTS[tuple(p["input_ids"])] = (kv, p.get("answer", {}))


class Rank:
    """One tensor-parallel worker: its agent, its cache (a region per layer), vLLM's
    notification handling."""

    def __init__(self, index):
        self.index = index
        # vLLM's agent config, but without NIXL's progress thread, which spins a core per
        # agent: the reaper below drives UCX's progress as it polls notifications.
        config = nixl_agent_config(enable_prog_thread=False, num_threads=4, backends=["UCX"])
        self.agent = nixl_agent(str(uuid.uuid4()), config)
        self.regions = [np.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in range(LAYERS)]
        descs = self.agent.get_reg_descs([(r.ctypes.data, r.nbytes, 0, "") for r in self.regions], "DRAM")
        self.agent.register_memory(descs)
        self.worker, self.poll = vllm_shim.worker(self.agent, self.heartbeat)

    def heartbeat(self, ids):
        """vLLM's _handle_heartbeat, as far as this mock goes: it never expires a request, so
        the lease is not extended; the ids are kept for /stats."""
        heartbeats[self.index].extend(ids.split(","))

    def write(self, rank, kv, blocks):
        """Writes rank `rank`'s heads of `kv` (canonical, one prompt) into `blocks`."""
        n = kv.shape[3]
        heads = slice(rank * RANK_HEADS, (rank + 1) * RANK_HEADS)
        for layer in range(LAYERS):
            # [head][token][K|V] for this rank's heads, padded to whole blocks.
            kvh = np.concatenate([kv[layer, 0, heads], kv[layer, 1, heads]], axis=-1)
            pad = len(blocks) * BLOCK_SIZE - n
            kvh = np.pad(kvh, ((0, 0), (0, pad), (0, 0)))
            for i, b in enumerate(blocks):
                part = kvh[:, i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]  # [head][token][2*hb]
                if LAYOUT == "LBNHC":
                    part = part.transpose(1, 0, 2)
                self.regions[layer][b * BLOCK_LEN:(b + 1) * BLOCK_LEN] = part.reshape(-1)


ranks = [Rank(i) for i in range(TP)]
ENGINE_ID = str(uuid.uuid4())  # one engine, its ranks' payloads all name it
payloads = {
    (0, t): vllm_shim.payload(
        r.agent, ENGINE_ID, [(m.ctypes.data, m.nbytes) for m in r.regions], NUM_BLOCKS,
        BLOCK_LEN, BLOCK_LEN, BLOCK_SIZE, LAYOUT,
    )
    for t, r in enumerate(ranks)
}
stop = vllm_shim.side_channel(payloads, side_port)

lock = threading.Lock()
rng = np.random.default_rng(11)
free = [int(b) for b in rng.permutation(NUM_BLOCKS)]
held = {}  # request id -> (blocks, ranks not yet done)
freed = []
# Per rank, the ids of each decode heartbeat ("HB:ids") its vLLM code handled.
heartbeats = [[] for _ in range(TP)]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self.answer(200, {})
        if self.path == "/stats":
            with lock:
                stats = {"held": sorted(held), "freed": freed, "free_blocks": len(free)}
                return self.answer(200, {**stats, "heartbeats": heartbeats})
        self.answer(404, {"error": "not found"})

    def do_POST(self):
        if self.path != "/v1/completions":
            return self.answer(404, {"error": "not found"})
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not (req.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return self.answer(400, {"error": "this mock only prefills for a remote decode"})
        kv, lie = PROMPTS.get(tuple(req["prompt"]), (None, None))
        if kv is None:
            return self.answer(400, {"error": "this MOCK serves only the prompts in its SPEC"})
        n = kv.shape[3]
        need = -(-n // BLOCK_SIZE)
        with lock:
            if need > len(free):
                return self.answer(503, {"error": "no free KV blocks"})
            blocks = [free.pop() for _ in range(need)]
        for t, r in enumerate(ranks):
            r.write(t, kv, blocks)
        rid = self.headers.get("X-Request-Id") or str(uuid.uuid4())
        request_id = f"cmpl-{rid}-0-{uuid.uuid4().hex[:8]}"
        with lock:
            held[request_id] = (blocks, set(range(TP)))
            for r in ranks:
                r.worker._reqs_to_send[request_id] = time.perf_counter() + 30
                r.worker._reqs_to_process.add(request_id)
        self.answer(200, {
            "id": f"cmpl-{rid}", "object": "text_completion", "model": "mock",
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1},
            "kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [blocks], "remote_engine_id": ENGINE_ID,
                "remote_request_id": request_id, "remote_host": "localhost",
                "remote_port": side_port, "tp_size": TP, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": n, "remote_blocks_expiry_time": None,
                "remote_registration_generation": 0, "transfer_mode": "pull",
                **lie,
            },
        })


def reap():
    """As vLLM's worker loop: polls each rank's notifications (which progresses its agent,
    serving the decode's READs); a request's blocks go back when every rank has freed it."""
    while not stop.is_set():
        for t, r in enumerate(ranks):
            done = r.poll()
            with lock:
                for request_id in done:
                    blocks, waiting = held[request_id]
                    waiting.discard(t)
                    if not waiting:
                        del held[request_id]
                        free.extend(blocks)
                        freed.append(request_id)
        time.sleep(0.001)


threading.Thread(target=reap, daemon=True).start()
server = ThreadingHTTPServer(("127.0.0.1", http_port), Handler)
print(json.dumps({"http": http_port, "side": side_port}), flush=True)
server.serve_forever()
