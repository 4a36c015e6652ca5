"""A MOCK SGLang prefill server, for tests: SGLang 0.5.23's own PD prefill classes
(CommonKVBootstrapServer, MooncakeKVManager in PREFILL mode, one MooncakeKVSender per request)
run unmodified from the wheel on CPU buffers, through the real Mooncake wheel; what SGLang's
scheduler and model runner would add is played by this script. There is no forward pass here
(no torch, no GPU): the KV of each prompt it serves was computed beforehand by handoff's engine
and is named in SPEC; a prompt it was not given is refused with 400.

argv: HTTP_PORT BOOT_PORT SPEC. SPEC is a JSON file: the layout (layers, page_size, kv_heads,
head_bytes), optionally `tp` (attention TP, default 1), and `prompts`, each {input_ids,
first_token, kv_file[, aux_room_delta[, aux_room_rank]]} (kv_file: every K/V buffer's pages in
turn; aux_room_delta: added to the room written in the metadata row, a corrupted row the
decode must refuse; aux_room_rank: only that tp rank writes it).

With tp N, N KV managers play SGLang's N tensor-parallel workers (one process each in
SGLang): rank t holds KV heads [t*H/N, (t+1)*H/N) of every token in a pool of its own,
registers with the bootstrap server as attn tp rank t, and sends its heads' slices of every
token slot to a TP-1 decode (SGLang's send_kvcache_slice), plus the metadata row.

Serves, as SGLang's HTTP server does:
- POST /generate with GenerateReqInput's input_ids, sampling_params, bootstrap_host,
  bootstrap_port, bootstrap_room: leases pages and a metadata row of its pools, writes the
  prompt's KV there, creates a sender per rank for the room (bootstrap_host:BOOT_PORT, as
  PrefillBootstrapQueue does), waits for the decode's transfer info, sends the pages in two
  chunks and the row, and answers once every sender reaches Success (500 if one fails);
- GET /health.
Prints one JSON line when ready: {"http": port, "bootstrap": port}."""
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(__file__))
from sgl_prefill_side import (  # noqa: E402  (sets the environment, installs the shim)
    AUX, CommonKVBootstrapServer, DisaggregationMode, KVPoll, MooncakeKVManager,
    MooncakeKVSender, kv_args, np, sgl_shim, start_mooncake, wait,
)

http_port, boot_port = int(sys.argv[1]), int(sys.argv[2])
spec = json.load(open(sys.argv[3]))
LAYERS, PAGE, HEADS, HEAD_BYTES = (spec[k] for k in ("layers", "page_size", "kv_heads", "head_bytes"))
TP = spec.get("tp", 1)
assert HEADS % TP == 0, "each tp rank holds whole heads"
RANK_HEADS = HEADS // TP
RANK_ITEM = PAGE * RANK_HEADS * HEAD_BYTES  # bytes of one page of one rank's K or V buffer
PROMPTS = {}
for p in spec["prompts"]:
    n = -(-len(p["input_ids"]) // PAGE)
    data = np.fromfile(p["kv_file"], dtype=np.uint8).reshape(2 * LAYERS, n, PAGE, HEADS, HEAD_BYTES)
    PROMPTS[tuple(p["input_ids"])] = (data, p["first_token"], p.get("aux_room_delta", 0),
                                      p.get("aux_room_rank"))
POOL_PAGES, AUX_ROWS = 64, 16

sgl_shim.CONFIG["disagg"].set(disaggregation_bootstrap_port=boot_port)
server_args = sgl_shim.Config("server_args", enable_pd_role_switch=False)
CommonKVBootstrapServer(host="127.0.0.1", port=boot_port)

start_mooncake()



class Rank:
    """One tensor-parallel worker's pool, as MHATokenToKVPool lays it out (per layer a K and a
    V tensor [rows, its heads, dim], one padding page; kv_data_ptrs = all K, then all V), its
    metadata rows, and its KV manager."""

    def __init__(self, t):
        self.t = t
        self.kv = [np.zeros(((POOL_PAGES + 1) * PAGE, RANK_HEADS, HEAD_BYTES), dtype=np.uint8)
                   for _ in range(2 * LAYERS)]
        self.aux = [np.zeros((AUX_ROWS, w), dtype=dt) for dt, w in AUX]
        sgl_shim.CONFIG["parallel"].set(attn_tp_size=TP, attn_tp_rank=t)
        args = kv_args(self.kv, self.aux, LAYERS, RANK_HEADS, PAGE, RANK_ITEM, total_heads=HEADS)
        args.engine_rank = t
        self.manager = MooncakeKVManager(args, DisaggregationMode.PREFILL, server_args,
                                         is_mla_backend=False)

    def write(self, pages, row, data, first_token, room):
        """Writes its heads of a prompt's KV into `pages` and its metadata `row`."""
        heads = slice(self.t * RANK_HEADS, (self.t + 1) * RANK_HEADS)
        for b, t in enumerate(self.kv):
            t.reshape(-1, PAGE, RANK_HEADS, HEAD_BYTES)[pages] = data[b][:, :, heads]
        for a in self.aux:
            a[row] = 0
        self.aux[0][row][0] = first_token
        self.aux[-1][row][0] = room % (1 << 64)


ranks = [Rank(t) for t in range(TP)]

# The scheduler's side: free pages (page 0 is padding) and rows, one lock for the pool and
# the manager's calls (SGLang's scheduler makes them from one thread).
lock = threading.Lock()
free_pages = list(range(1, POOL_PAGES + 1))
free_rows = list(range(AUX_ROWS))


def prefill(req):
    """Runs one request: (status, answer)."""
    ids = req.get("input_ids")
    room = req.get("bootstrap_room")
    if not isinstance(ids, list) or not isinstance(room, int) or not req.get("bootstrap_host"):
        return 400, {"error": {"message": "input_ids, bootstrap_host and bootstrap_room are required"}}
    known = PROMPTS.get(tuple(ids))
    if known is None:
        return 400, {"error": {"message": "mock server: no KV was given for this prompt"}}
    data, first_token, delta, delta_rank = known
    n = data.shape[1]
    with lock:
        if len(free_pages) < n or not free_rows:
            return 503, {"error": {"message": "the KV pool is full"}}
        pages = np.array([free_pages.pop() for _ in range(n)], dtype=np.int32)
        row = free_rows.pop()
        senders = []
        for r in ranks:
            wrong = delta_rank is None or delta_rank == r.t
            r.write(pages, row, data, first_token, room + (delta if wrong else 0))
            senders.append(MooncakeKVSender(
                mgr=r.manager, bootstrap_addr=f"{req['bootstrap_host']}:{boot_port}",
                bootstrap_room=room, req_has_disagg_prefill_dp_rank=False))
    try:
        for sender in senders:
            if wait(sender, {KVPoll.WaitingForInput}, 30) != KVPoll.WaitingForInput:
                return 500, {"error": {"message": "no decode asked for the room"}}
        with lock:
            cut = max(1, n - 1)
            for sender in senders:
                sender.init(num_kv_indices=n, aux_index=row)
                sender.send(pages[:cut])  # two chunks, as chunked prefill sends them
                if cut < n:
                    sender.send(pages[cut:])
        for sender in senders:
            state = wait(sender, {KVPoll.Success}, 30)
            if state != KVPoll.Success:
                return 500, {"error": {"message": f"KV transfer failed (poll {state})"}}
        return 200, {"text": "", "output_ids": [first_token], "meta_info": {
            "id": str(room), "prompt_tokens": len(ids), "completion_tokens": 1,
            "cached_tokens": 0, "finish_reason": {"type": "length", "length": 1}}}
    finally:
        with lock:
            for sender in senders:
                sender.clear()
            free_pages.extend(int(p) for p in pages)
            free_rows.append(row)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def answer(self, status, body):
        out = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        if self.path == "/health":
            self.answer(200, {})
        else:
            self.answer(404, {"error": {"message": "not found"}})

    def do_POST(self):
        if self.path != "/generate":
            return self.answer(404, {"error": {"message": "not found"}})
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except ValueError as e:
            return self.answer(400, {"error": {"message": f"not JSON: {e}"}})
        self.answer(*prefill(req))


server = ThreadingHTTPServer(("127.0.0.1", http_port), Handler)
print(json.dumps({"http": http_port, "bootstrap": boot_port}), flush=True)
server.serve_forever()
