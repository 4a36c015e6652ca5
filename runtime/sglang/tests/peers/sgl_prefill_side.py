"""What the scripts driving SGLang 0.5.23's own prefill-side classes share: the environment
(TCP Mooncake, local IP), SGLang's imports behind the shim (`sgl_shim`), the pool's metadata
rows, the `KVArgs` of a CPU pool, and waiting on a sender's `KVPoll`."""
import logging
import os
import sys
import time

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import sgl_shim  # noqa: E402,F401  (before any sglang import)

logging.basicConfig(level=logging.WARNING)
if not hasattr(logging.Logger, "warning_once"):
    logging.Logger.warning_once = logging.Logger.warning

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer  # noqa: E402,F401
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVSender  # noqa: E402,F401
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402,F401

# MetadataBuffers rows without speculative decoding: (dtype, width); bootstrap_room last.
AUX = [(np.int32, 16), (np.int32, 16), (np.float32, 16), (np.int32, 16), (np.float32, 128),
       (np.int32, 128), (np.float32, 16), (np.int64, 16), (np.float32, 16), (np.uint64, 8)]


def start_mooncake():
    """SGLang's own Mooncake transfer engine, on this host's address."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )
    from sglang.srt.utils.network import get_local_ip_auto
    init_mooncake_transfer_engine(hostname=get_local_ip_auto(), gpu_id=0, ib_device=None)


def kv_args(kv, aux, layers, heads, page, item_len, total_heads=None):
    """The KVArgs of a CPU pool: `kv` (every K buffer, then every V), `aux` (metadata rows);
    `heads` of the model's `total_heads` (default all of them) on this rank."""
    args = KVArgs()
    args.engine_rank, args.pp_rank, args.system_dp_rank, args.rust_http_port = 0, 0, None, None
    args.kv_cache_dtype_str, args.kv_layout = "auto", None
    args.prefill_start_layer, args.prefill_end_layer = 0, layers
    args.kv_data_ptrs = [t.ctypes.data for t in kv]
    args.kv_data_lens = [t.nbytes for t in kv]  # dtype does not matter to the transfer
    args.kv_item_lens = [item_len] * len(kv)
    args.num_draft_entries, args.kv_layer_ids = 0, []
    args.kv_head_num, args.total_kv_head_num = heads, total_heads or heads
    args.page_size = page
    args.aux_data_ptrs = [a.ctypes.data for a in aux]
    args.aux_data_lens = [a.nbytes for a in aux]
    args.aux_item_lens = [a[0].nbytes for a in aux]
    args.ib_device, args.gpu_id = None, 0
    args.state_types, args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], [], []
    args.state_dim_per_tensor, args.state_slice_outer_counts, args.state_layer_ids = [], [], []
    args.is_hybrid_mla_backend, args.state_conv_shard_groups = False, []
    args.swa_kv_cache_layout, args.mla_compression_ratios = None, None
    return args


def wait(sender, states, timeout):
    """Polls `sender` until it reaches one of `states` (or Failed), at most `timeout` s."""
    end = time.time() + timeout
    while time.time() < end:
        s = sender.poll()
        if s in states or s == KVPoll.Failed:
            return s
        time.sleep(0.002)
    return sender.poll()
