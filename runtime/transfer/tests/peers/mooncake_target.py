"""The Mooncake wheel as a target: registers a zeroed buffer of LEN bytes (argv 1), prints one
JSON line with its segment name and the buffer's address, then, on each line read from stdin,
prints the sha256 of the buffer; exits at EOF."""
import ctypes, hashlib, json, sys

from mooncake.engine import TransferEngine

length = int(sys.argv[1])
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = (ctypes.c_ubyte * length)()
addr = ctypes.addressof(buf)
assert te.register_memory(addr, length) == 0
session = f"127.0.0.1:{te.get_rpc_port()}"
print(json.dumps({"session": session, "addr": addr, "len": length}), flush=True)
for _ in sys.stdin:
    print(hashlib.sha256(bytes(buf)).hexdigest(), flush=True)
