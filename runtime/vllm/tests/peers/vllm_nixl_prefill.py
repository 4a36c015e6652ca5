"""vLLM 0.33's own NIXL prefill side, pull mode (vLLM's default: the decode READs), over a
real NIXL agent (the nixl-cu13 wheel, UCX over TCP) holding a DRAM "KV cache". The vLLM code
is the wheel's, unmodified, taken by scripts/fetch-peers into $venv/vllm-src and loaded by
path; what it imports is stood in for (vLLM itself does not import without torch):
- metadata.py: NixlAgentMetadata and NixlHandshakePayload, encoded as base_worker.py does
  (msgspec msgpack, the agent metadata inside the payload);
- base_scheduler.py: NixlBaseConnectorScheduler.set_xfer_handshake_metadata, which starts
  _nixl_handshake_listener, the ZMQ ROUTER side channel that answers get_meta_msg;
- pull_worker.py: NixlPullConnectorWorker._get_new_notifs, which frees a request's blocks once
  every consumer has sent its "<request id>:<consumers>" notification;
- nixl/utils.py: zmq_ctx, the listener's socket.
Stand-ins: vLLM's logger (logging), make_zmq_path and make_zmq_socket (a bound ROUTER), and
classes for the names only type hints and other code paths use.

The cache: LAYERS layers, K and V regions each (vLLM's split FlashAttention layout, NHD),
NUM_BLOCKS blocks of BLOCK_LEN bytes, STRIDE bytes apart, random bytes.

argv: PORT. First line: {"engine_id", "regions", "num_blocks", "block_len", "block_size"}.
stdin, one JSON object per line:
  {"cmd": "send", "req": ID, "blocks": [...]}  -> the request's blocks wait for their reader;
      prints {"req": ID, "sha256": [hex of each region's block, region-major]}
  {"cmd": "quit"}
Prints {"freed": [ID, ...]} when vLLM's code frees requests.
"""
import collections
import json
import logging
import os
import re
import select
import sys
import threading
import time
import types
import uuid
import hashlib
import importlib.util

import msgspec
import numpy as np
import zmq
from nixl_cu13._api import nixl_agent, nixl_agent_config

LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, ELEM = 4, 64, 16, 3, 64, 4
BLOCK_LEN = BLOCK_SIZE * HEADS * HEAD_DIM * ELEM
# Blocks twice their length apart, so a reader that steps by the length reads wrong blocks.
STRIDE = 2 * BLOCK_LEN

src = os.path.join(os.path.dirname(sys.executable), "..", "vllm-src", "vllm")
NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


class _Meta(type):
    def __getattr__(cls, name):
        return stub(name)


def stub(name):
    """A class for a name vLLM imports but this code path never really uses."""
    return _Meta(name, (), {"__init__": lambda self, *a, **k: None})


class StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = stub(name)
        setattr(self, name, value)
        return value


def module(name, **attrs):
    m = StubModule(name)
    m.__dict__.update(attrs)
    m.__path__ = []
    sys.modules[name] = m
    return m


def from_file(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


def make_zmq_path(scheme, host, port=None):
    return f"{scheme}://{host}:{port}"


def make_zmq_socket(ctx, path, socket_type, bind=False, identity=None, linger=None):
    sock = ctx.socket(socket_type)
    sock.bind(path) if bind else sock.connect(path)
    return sock


for pkg in [
    "vllm", "vllm.config", "vllm.distributed", "vllm.distributed.kv_transfer",
    "vllm.distributed.kv_transfer.kv_connector", "vllm.distributed.kv_transfer.kv_connector.v1",
    NIXL, "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched",
]:
    module(pkg)
for name in [
    "vllm.envs", "vllm.distributed.kv_transfer.kv_connector.utils",
    "vllm.distributed.kv_transfer.kv_connector.v1.base", f"{NIXL}.base_worker", f"{NIXL}.tp_mapping",
    "vllm.utils.math_utils", "vllm.v1.core.sched.output", "vllm.v1.kv_cache_interface",
]:
    module(name)
module("vllm.logger", init_logger=logging.getLogger)
module("vllm.platforms", current_platform=types.SimpleNamespace(get_nixl_supported_devices=dict))
module("vllm.utils.network_utils", make_zmq_path=make_zmq_path, make_zmq_socket=make_zmq_socket)
module("regex", **{k: getattr(re, k) for k in ["compile", "IGNORECASE"]})
# NixlHandshakePayload's base: a plain ABC in vLLM.
sys.modules["vllm.distributed.kv_transfer.kv_connector.v1.base"].KVConnectorHandshakeMetadata = type(
    "KVConnectorHandshakeMetadata", (), {}
)

nixl_dir = os.path.join(src, "distributed", "kv_transfer", "kv_connector", "v1", "nixl")
metadata = from_file(f"{NIXL}.metadata", os.path.join(nixl_dir, "metadata.py"))
from_file(f"{NIXL}.utils", os.path.join(nixl_dir, "utils.py"))
base_scheduler = from_file(f"{NIXL}.base_scheduler", os.path.join(nixl_dir, "base_scheduler.py"))
pull_worker = from_file(f"{NIXL}.pull_worker", os.path.join(nixl_dir, "pull_worker.py"))


def main():
    port = int(sys.argv[1])
    # As vLLM's worker makes its agent (base_worker.py).
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(num_threads=4, backends=["UCX"]))
    rng = np.random.default_rng(7)
    regions = [rng.integers(0, 256, NUM_BLOCKS * STRIDE, dtype=np.uint8) for _ in range(2 * LAYERS)]
    descs = agent.get_reg_descs([(r.ctypes.data, r.nbytes, 0, "") for r in regions], "DRAM")
    agent.register_memory(descs)
    engine_id = str(uuid.uuid4())
    agent_metadata = metadata.NixlAgentMetadata(
        engine_id=engine_id,
        agent_metadata=agent.get_agent_metadata(),
        kv_caches_base_addr=[r.ctypes.data for r in regions],
        device_id=0,
        num_blocks=NUM_BLOCKS,
        block_lens=[BLOCK_LEN] * len(regions),
        block_strides=[STRIDE] * len(regions),
        kv_cache_layout="NHD",
        block_size=BLOCK_SIZE,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
    )
    encoder = msgspec.msgpack.Encoder()
    payload = metadata.NixlHandshakePayload(
        compatibility_hash="handoff-test", agent_metadata_bytes=encoder.encode(agent_metadata)
    )
    scheduler = types.SimpleNamespace(
        _handshake_data={},
        _registration_generation=0,
        _nixl_handshake_listener_t=None,
        _stop_event=threading.Event(),
        side_channel_host="127.0.0.1",
        side_channel_port=port,
        _nixl_handshake_listener=base_scheduler.NixlBaseConnectorScheduler._nixl_handshake_listener,
    )
    set_meta = base_scheduler.NixlBaseConnectorScheduler.set_xfer_handshake_metadata
    set_meta(scheduler, {(0, 0): payload})
    worker = types.SimpleNamespace(
        nixl_wrapper=agent,
        transfer_topo=object(),
        xfer_stats=types.SimpleNamespace(record_notification_after_expiry=lambda: None),
        expected_consumer_notifications_by_req={},
        consumer_notification_counts_by_req=collections.defaultdict(int),
        _reqs_to_send={},
        _reqs_to_process=set(),
        _handle_heartbeat=lambda payload: None,
    )
    get_new_notifs = pull_worker.NixlPullConnectorWorker._get_new_notifs
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
        freed = get_new_notifs(worker)
        if freed:
            print(json.dumps({"freed": sorted(freed)}), flush=True)
    scheduler._stop_event.set()


if __name__ == "__main__":
    main()
