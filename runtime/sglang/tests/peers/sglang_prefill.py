"""SGLang 0.5.23's own prefill-side KV sender (CommonKVBootstrapServer, MooncakeKVManager in
PREFILL mode, MooncakeKVSender), unmodified, on CPU buffers, through the real Mooncake wheel.

argv: BOOT_PORT ROOM [AUX_ROOM [SPEC]]. Serves SGLang's bootstrap directory on BOOT_PORT,
prints one JSON line (the layout and the sha256 of every source buffer's pages, in send
order), then sends ROOM's pages and its metadata row to whichever decode asks, and exits 0
once the sender reaches Success (1 otherwise). AUX_ROOM, when given, is written into the
row's bootstrap_room instead of ROOM (a corrupted row the decode must refuse). SPEC, when
given, is a JSON file naming a real model's layout, first token and pages (a file of every
K/V buffer's pages in turn); without it, 4 pages of random bytes of a small model."""
import hashlib
import json
import logging
import os
import sys
import time

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import sgl_shim  # noqa: E402  (before any sglang import)

logging.basicConfig(level=logging.WARNING)
if not hasattr(logging.Logger, "warning_once"):
    logging.Logger.warning_once = logging.Logger.warning

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer  # noqa: E402
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVSender  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402

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
# MetadataBuffers rows without speculative decoding: (dtype, width); bootstrap_room last.
AUX = [(np.int32, 16), (np.int32, 16), (np.float32, 16), (np.int32, 16), (np.float32, 128),
       (np.int32, 128), (np.float32, 16), (np.int64, 16), (np.float32, 16), (np.uint64, 8)]

sgl_shim.CONFIG["disagg"].set(disaggregation_bootstrap_port=boot_port)
server_args = sgl_shim.Config("server_args", enable_pd_role_switch=False)
CommonKVBootstrapServer(host="127.0.0.1", port=boot_port)

from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (  # noqa: E402
    init_mooncake_transfer_engine,
)
from sglang.srt.utils.network import get_local_ip_auto  # noqa: E402

init_mooncake_transfer_engine(hostname=get_local_ip_auto(), gpu_id=0, ib_device=None)

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

args = KVArgs()
args.engine_rank, args.pp_rank, args.system_dp_rank, args.rust_http_port = 0, 0, None, None
args.kv_cache_dtype_str, args.kv_layout = "auto", None
args.prefill_start_layer, args.prefill_end_layer = 0, LAYERS
args.kv_data_ptrs = [t.ctypes.data for t in kv]
args.kv_data_lens = [t.nbytes for t in kv]  # dtype does not matter to the transfer
args.kv_item_lens = [ITEM_LEN] * len(kv)
args.num_draft_entries, args.kv_layer_ids = 0, []
args.kv_head_num = args.total_kv_head_num = HEADS
args.page_size = PAGE
args.aux_data_ptrs = [a.ctypes.data for a in aux]
args.aux_data_lens = [a.nbytes for a in aux]
args.aux_item_lens = [a[0].nbytes for a in aux]
args.ib_device, args.gpu_id = None, 0
args.state_types, args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], [], []
args.state_dim_per_tensor, args.state_slice_outer_counts, args.state_layer_ids = [], [], []
args.is_hybrid_mla_backend, args.state_conv_shard_groups = False, []
args.swa_kv_cache_layout, args.mla_compression_ratios = None, None

manager = MooncakeKVManager(args, DisaggregationMode.PREFILL, server_args, is_mla_backend=False)
pages = [t.reshape(-1, ITEM_LEN)[SRC_PAGES] for t in kv]
print(json.dumps({
    "layers": LAYERS, "page_size": PAGE, "kv_heads": HEADS, "head_bytes": HEAD_BYTES,
    "aux_row_bytes": [a[0].nbytes for a in aux], "first_token": FIRST_TOKEN,
    "sha256": [hashlib.sha256(p.tobytes()).hexdigest() for p in pages],
}), flush=True)

sender = MooncakeKVSender(mgr=manager, bootstrap_addr=f"127.0.0.1:{boot_port}",
                          bootstrap_room=room, req_has_disagg_prefill_dp_rank=False)


def wait(states, timeout):
    end = time.time() + timeout
    while time.time() < end:
        s = sender.poll()
        if s in states or s == KVPoll.Failed:
            return s
        time.sleep(0.005)
    return sender.poll()


if wait({KVPoll.WaitingForInput}, 60) != KVPoll.WaitingForInput:
    sys.exit(1)
sender.init(num_kv_indices=len(SRC_PAGES), aux_index=AUX_ROW)
cut = max(1, len(SRC_PAGES) - 1)
sender.send(SRC_PAGES[:cut])  # two chunks, as chunked prefill sends them
if cut < len(SRC_PAGES):
    sender.send(SRC_PAGES[cut:])
state = wait({KVPoll.Success}, 30)
sender.clear()
sys.exit(0 if state == KVPoll.Success else 1)
