"""Lets SGLang 0.5.23's PD KV-transfer classes import on a CPU-only machine without torch.

SGLang's own files are not modified. What is replaced, and why it is safe on the path the
tests drive (MooncakeKVManager in PREFILL mode, MooncakeKVSender, CommonKVBootstrapServer;
facts from ../shared/interop/sglang-sender.md):
- torch, torch.distributed: imported at module level, never run here; the transfer worker
  calls isinstance(x, torch.Tensor), so Tensor is a real (empty) class.
- the package __init__s of sglang, sglang.srt.distributed and sglang.srt.utils: skipped (they
  import transformers, torch and HF patches); their real __path__ is kept.
- sglang.srt.utils.common: five small helpers the path calls, taken from the wheel's own
  source by name, plus is_npu() = False.
- server_args, configs.model_config, distributed.parallel_state, mem_cache.page_interleave,
  observability.req_time_stats, triton and sglang.kernels' pointer-table module: attribute
  stubs (types, decorators and branches this path never takes);
  parallel_state.get_mooncake_transfer_engine delegates to SGLang's real one.
- runtime_context: strict namespaces holding exactly the config this path reads; any other
  read raises, naming the leaf.
"""
import ast
import importlib.util
import os
import socket
import sys
import threading
import types
from typing import Any, Callable
from unittest import mock


class Stub(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return mock.MagicMock(name=f"{self.__name__}.{item}")


def install(name, module):
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def package_without_init(name):
    module = types.ModuleType(name)
    module.__path__ = list(importlib.util.find_spec(name).submodule_search_locations)
    return install(name, module)


def functions_from(relpath, names, env):
    root = sys.modules["sglang"].__path__[0]
    with open(os.path.join(root, relpath)) as f:
        tree = ast.parse(f.read())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    scope = dict(env)
    exec(compile(ast.Module(body=wanted, type_ignores=[]), relpath, "exec"), scope)
    return {n: scope[n] for n in names}


torch = install("torch", Stub("torch"))
torch.Tensor = type("Tensor", (), {})
install("torch.distributed", Stub("torch.distributed"))

package_without_init("sglang")
package_without_init("sglang.srt.distributed")
utils = package_without_init("sglang.srt.utils")
common = install("sglang.srt.utils.common", types.ModuleType("sglang.srt.utils.common"))
helpers = functions_from(
    "srt/utils/common.py",
    ["ceil_div", "ceil_align", "run_with_deadline", "get_int_env_var", "get_bool_env_var"],
    {"threading": threading, "socket": socket, "os": os, "Callable": Callable, "Any": Any},
)
for name, fn in helpers.items():
    setattr(common, name, fn)
    setattr(utils, name, fn)
utils.is_npu = common.is_npu = lambda: False
for name in ["create_device_event", "create_device_stream", "device_stream_context"]:
    setattr(utils, name, mock.MagicMock(name=name))

for name in [
    "sglang.srt.server_args",
    "sglang.srt.configs.model_config",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.mem_cache.page_interleave",
    "sglang.srt.observability.req_time_stats",
    # For heterogeneous TP: send_kvcache_slice imports compute_head_slice_params from
    # common/staging_buffer.py, whose module level imports triton and a CUDA pointer-table
    # kernel (used only by the staging path, off here).
    "triton",
    "triton.language",
    "sglang.kernels",
    "sglang.kernels.ops",
    "sglang.kernels.ops.memory",
    "sglang.kernels.ops.memory.ptr_table",
]:
    install(name, Stub(name))


def get_mooncake_transfer_engine():
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        get_mooncake_transfer_engine as real,
    )

    return real()


sys.modules["sglang.srt.distributed.parallel_state"].get_mooncake_transfer_engine = (
    get_mooncake_transfer_engine
)


class Config:
    """A namespace that answers only the leaves it was given."""

    def __init__(self, ns, **leaves):
        self.__dict__["_ns"], self.__dict__["_leaves"] = ns, leaves

    def __getattr__(self, key):
        if key.startswith("__"):
            raise AttributeError(key)
        if key not in self._leaves:
            raise AttributeError(f"sgl_shim: config leaf {self._ns}.{key} not provided")
        return self._leaves[key]

    def set(self, **leaves):
        self._leaves.update(leaves)


CONFIG = dict(
    serving=Config("serving", host="127.0.0.1", port=30000),
    disagg=Config(
        "disagg",
        disaggregation_bootstrap_port=8998,
        disaggregation_decode_allocation_policy="early",
    ),
    parallel=Config(
        "parallel",
        dist_init_addr=None,
        attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0,
        attn_dcp_size=1, attn_dcp_rank=0, attn_dp_size=1, attn_dp_rank=0,
        dp_size=1, pp_size=1, num_dp_ranks=1,
        enable_kv_cache_sharding=False, enable_dsa_cache_layer_split=False,
        enable_cp_tp_group_sharing=False, load_balance_method="follow_bootstrap_room",
        pp_group=None,
    ),
    observability=Config("observability", enable_trace=False),
    memory=Config("memory", enable_unified_memory=False),
    spec=Config("spec", speculative_algorithm=None),
    device=Config("device"), schedule=Config("schedule"), exec=Config("exec"),
    resources=Config("resources"),
)
context = types.ModuleType("sglang.srt.runtime_context")
for ns in CONFIG:
    setattr(context, f"get_{ns}", (lambda key: (lambda: CONFIG[key]))(ns))
context.linear_attn_tp_size = lambda: CONFIG["parallel"].attn_tp_size
context.max_prefill_buffer_tokens = lambda: CONFIG["schedule"].chunked_prefill_size
install("sglang.srt.runtime_context", context)
