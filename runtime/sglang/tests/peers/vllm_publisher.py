"""vLLM 0.33's own KV event publisher (`ZmqEventPublisher` from
vllm/distributed/kv_events.py, unmodified, taken from the wheel by scripts/fetch-peers into
$venv/vllm-src), one per dp rank. vLLM itself is not importable without torch; the file is
loaded by path with five small stand-ins for what it imports:
- vllm.logger.init_logger: logging.getLogger;
- vllm.config.utils.config: dataclasses.dataclass (the config file, loaded by path too);
- vllm.utils.network_utils: the four helpers, used only to bind port 0;
- vllm.v1.core.kv_cache_utils.ExternalBlockHash: bytes | int.

argv: PORT REPLAY_PORT DP. Same commands on stdin as sglang_publisher.py; "stored" takes
"block_size" tokens per block."""
import dataclasses
import importlib.util
import ipaddress
import logging
import os
import sys
import time
import types

src = os.path.join(os.path.dirname(sys.executable), "..", "vllm-src")


def module(name, **attrs):
    m = types.ModuleType(name)
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


def is_valid_ipv6_address(a):
    try:
        return isinstance(ipaddress.ip_address(a), ipaddress.IPv6Address)
    except ValueError:
        return False


for pkg in ["vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed"]:
    module(pkg)
module("vllm.logger", init_logger=logging.getLogger)
module("vllm.config.utils", config=dataclasses.dataclass)
module("vllm.utils.network_utils", get_ip=lambda: "127.0.0.1",
       get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
       is_valid_ipv6_address=is_valid_ipv6_address,
       split_zmq_path=lambda p: (p.split("://")[0], *p.split("://")[1].rsplit(":", 1)))
module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
from_file("vllm.config.kv_events", os.path.join(src, "vllm/config/kv_events.py"))
kv = from_file("vllm.distributed.kv_events", os.path.join(src, "vllm/distributed/kv_events.py"))
sys.path.insert(0, os.path.dirname(__file__))
import event_commands  # noqa: E402

port, replay, dp = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
publishers = event_commands.start(lambda: [
    kv.ZmqEventPublisher(data_parallel_rank=r, endpoint=f"tcp://*:{port}",
                         replay_endpoint=f"tcp://*:{replay}", topic="kv")
    for r in range(dp)
])
event_commands.serve(
    publishers,
    stored=lambda s: kv.BlockStored(block_hashes=s["hashes"], parent_block_hash=s.get("parent"),
                                    token_ids=s["tokens"], block_size=s["block_size"],
                                    lora_id=None, medium="GPU", lora_name=None),
    removed=lambda hashes: kv.BlockRemoved(block_hashes=hashes, medium="GPU"),
    cleared=kv.AllBlocksCleared,
    batch=lambda events: kv.KVEventBatch(ts=time.time(), events=events),
)
