"""SGLang 0.5.23's own prefill-side KV sender (CommonKVBootstrapServer, MooncakeKVManager in
PREFILL mode, MooncakeKVSender), unmodified, on CPU buffers, through the real Mooncake wheel.

argv: BOOT_PORT ROOM [AUX_ROOM [SPEC]]. Serves SGLang's bootstrap directory on BOOT_PORT,
prints one JSON line (the layout and the sha256 of every source buffer's pages, in send
order), then sends ROOM's pages and its metadata row to whichever decode asks, and exits 0
once the sender reaches Success (1 otherwise). When BOOT_PORT is taken (another process
bound it after the test picked it), prints {"port_taken": BOOT_PORT} instead and exits 75, so
the test can pick another. AUX_ROOM, when given, is written into the
row's bootstrap_room instead of ROOM (a corrupted row the decode must refuse). SPEC, when
given, is a JSON file naming a real model's layout, first token and pages (a file of every
K/V buffer's pages in turn); without it, 4 pages of random bytes of a small model."""
import errno
import hashlib
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from sgl_prefill_side import (  # noqa: E402  (sets the environment, installs the shim)
    AUX, CommonKVBootstrapServer, DisaggregationMode, KVPoll, MooncakeKVManager,
    MooncakeKVSender, kv_args, np, sgl_shim, start_mooncake, wait,
)

boot_port, room = int(sys.argv[1]), int(sys.argv[2])
aux_room = int(sys.argv[3]) if len(sys.argv) > 3 else room
spec = json.load(open(sys.argv[4])) if len(sys.argv) > 4 else None
if spec:
    LAYERS, PAGE, HEADS, HEAD_BYTES = (spec[k] for k in ("layers", "page_size", "kv_heads", "head_bytes"))
    FIRST_TOKEN, N = spec["first_token"], spec["pages"]
    SRC_PAGES = np.array([3 + 2 * i for i in range(N)], dtype=np.int32)  # scattered, as a pool's are
else:
    LAYERS, PAGE, HEADS, HEAD_BYTES = 2, 16, 2, 16  # fp16, head_dim 8
    FIRST_TOKEN = 31337
    SRC_PAGES = np.array([3, 4, 5, 9], dtype=np.int32)
ITEM_LEN = PAGE * HEADS * HEAD_BYTES  # bytes of one page of one K or V buffer
POOL_PAGES, AUX_ROWS, AUX_ROW = int(SRC_PAGES.max()) + 4, 8, 1

sgl_shim.CONFIG["disagg"].set(disaggregation_bootstrap_port=boot_port)
server_args = sgl_shim.Config("server_args", enable_pd_role_switch=False)
boot = CommonKVBootstrapServer(host="127.0.0.1", port=boot_port)


def port_in_use(port):
    """Whether binding `port` on loopback fails because something holds it."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        return False
    except OSError as e:
        return e.errno == errno.EADDRINUSE
    finally:
        s.close()


# The server is ready once its site listens (aiohttp lists no address before the bind
# succeeded); its thread ends at once when the bind fails.
deadline = time.monotonic() + 60
while not (getattr(boot, "_runner", None) and boot._runner.addresses):
    if not boot.thread.is_alive():
        if port_in_use(boot_port):
            print(json.dumps({"port_taken": boot_port}), flush=True)
            sys.exit(75)
        sys.exit("SGLang's bootstrap server stopped before it listened")
    if time.monotonic() > deadline:
        sys.exit("SGLang's bootstrap server did not listen within 60 s")
    time.sleep(0.005)

start_mooncake()

# The pool as MHATokenToKVPool lays it out: per layer a K and a V tensor [rows, heads, dim],
# one padding page; kv_data_ptrs = all K, then all V.
rng = np.random.default_rng(room % (1 << 32))
kv = [np.zeros(((POOL_PAGES + 1) * PAGE, HEADS, HEAD_BYTES), dtype=np.uint8)
      for _ in range(2 * LAYERS)]
for t in kv:
    t[...] = rng.integers(0, 256, t.shape, dtype=np.uint8)
if spec:
    data = np.fromfile(spec["kv_file"], dtype=np.uint8).reshape(2 * LAYERS, N, ITEM_LEN)
    for b, t in enumerate(kv):
        t.reshape(-1, ITEM_LEN)[SRC_PAGES] = data[b]
aux = [np.zeros((AUX_ROWS, w), dtype=dt) for dt, w in AUX]
aux[0][AUX_ROW][0] = FIRST_TOKEN
aux[-1][AUX_ROW][0] = aux_room

args = kv_args(kv, aux, LAYERS, HEADS, PAGE, ITEM_LEN)

manager = MooncakeKVManager(args, DisaggregationMode.PREFILL, server_args, is_mla_backend=False)
pages = [t.reshape(-1, ITEM_LEN)[SRC_PAGES] for t in kv]
print(json.dumps({
    "layers": LAYERS, "page_size": PAGE, "kv_heads": HEADS, "head_bytes": HEAD_BYTES,
    "aux_row_bytes": [a[0].nbytes for a in aux], "first_token": FIRST_TOKEN,
    "sha256": [hashlib.sha256(p.tobytes()).hexdigest() for p in pages],
}), flush=True)

sender = MooncakeKVSender(mgr=manager, bootstrap_addr=f"127.0.0.1:{boot_port}",
                          bootstrap_room=room, req_has_disagg_prefill_dp_rank=False)


if wait(sender, {KVPoll.WaitingForInput}, 60) != KVPoll.WaitingForInput:
    sys.exit(1)
sender.init(num_kv_indices=len(SRC_PAGES), aux_index=AUX_ROW)
cut = max(1, len(SRC_PAGES) - 1)
sender.send(SRC_PAGES[:cut])  # two chunks, as chunked prefill sends them
if cut < len(SRC_PAGES):
    sender.send(SRC_PAGES[cut:])
state = wait(sender, {KVPoll.Success}, 30)
sender.clear()
sys.exit(0 if state == KVPoll.Success else 1)
