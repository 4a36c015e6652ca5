"""vLLM 0.33's NIXL connector code from its wheel (taken by scripts/fetch-peers into
$venv/vllm-src), loaded by path with stand-ins for what it imports: vLLM itself does not
import without torch. Used by vllm_nixl_prefill.py and vllm_server.py.
- metadata: NixlAgentMetadata and NixlHandshakePayload (msgspec);
- base_scheduler: NixlBaseConnectorScheduler (set_xfer_handshake_metadata starts
  _nixl_handshake_listener, the ZMQ ROUTER side channel that answers get_meta_msg);
- pull_worker: NixlPullConnectorWorker (_get_new_notifs frees a request once every consumer
  has sent its "<request id>:<consumers>" notification).
Stand-ins: vLLM's logger (logging), make_zmq_path and make_zmq_socket (a bound ROUTER), and
classes for the names only type hints and other code paths use.
"""
import collections
import importlib.util
import logging
import os
import re
import sys
import threading
import types

import msgspec

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


def _listener_or_exit(*args):
    """vLLM's side-channel listener; if it fails (its port taken by another process since
    the test found it free), the process exits, so the test sees a server that did not start
    and tries other ports. (vLLM waits for the listener's ready event with no timeout: a
    listener that dies before setting it would hang the server, and the test with it.)"""
    try:
        base_scheduler.NixlBaseConnectorScheduler._nixl_handshake_listener(*args)
    except Exception as e:  # noqa: BLE001 - any failure: the server cannot serve handshakes
        print(f"the side channel failed: {e!r}", file=sys.stderr, flush=True)
        os._exit(1)


def side_channel(payloads, port):
    """Starts vLLM's side channel on 127.0.0.1:port answering with payloads, a dict
    {(pp_rank, tp_rank): NixlHandshakePayload}; returns its stop event. The process exits if
    the listener fails."""
    scheduler = types.SimpleNamespace(
        _handshake_data={},
        _registration_generation=0,
        _nixl_handshake_listener_t=None,
        _stop_event=threading.Event(),
        side_channel_host="127.0.0.1",
        side_channel_port=port,
        _nixl_handshake_listener=_listener_or_exit,
    )
    base_scheduler.NixlBaseConnectorScheduler.set_xfer_handshake_metadata(scheduler, payloads)
    return scheduler._stop_event


def payload(agent, engine_id, regions, num_blocks, block_len, stride, block_size, layout):
    """A prefill worker's NixlHandshakePayload, encoded as base_worker.py does: its engine,
    its agent's metadata and cache, regions being (address, bytes) of each registered layer."""
    meta = metadata.NixlAgentMetadata(
        engine_id=engine_id,
        agent_metadata=agent.get_agent_metadata(),
        kv_caches_base_addr=[addr for addr, _ in regions],
        device_id=0,
        num_blocks=num_blocks,
        block_lens=[block_len] * len(regions),
        block_strides=[stride] * len(regions),
        kv_cache_layout=layout,
        block_size=block_size,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
    )
    encoded = msgspec.msgpack.Encoder().encode(meta)
    return metadata.NixlHandshakePayload(
        compatibility_hash="handoff-test", agent_metadata_bytes=encoded
    )


def worker(agent, on_heartbeat):
    """What NixlPullConnectorWorker._get_new_notifs reads of its worker, for `agent`; returns
    (state, poll): state._reqs_to_send/_reqs_to_process take requests waiting for their
    reader, and poll() returns the ids vLLM's code frees. A decode's heartbeat ("HB:ids"),
    which vLLM's code hands its worker's _handle_heartbeat, goes to on_heartbeat(ids)."""
    state = types.SimpleNamespace(
        nixl_wrapper=agent,
        transfer_topo=object(),
        xfer_stats=types.SimpleNamespace(record_notification_after_expiry=lambda: None),
        expected_consumer_notifications_by_req={},
        consumer_notification_counts_by_req=collections.defaultdict(int),
        _reqs_to_send={},
        _reqs_to_process=set(),
        _handle_heartbeat=on_heartbeat,
    )
    get_new_notifs = pull_worker.NixlPullConnectorWorker._get_new_notifs
    return state, lambda: get_new_notifs(state)
