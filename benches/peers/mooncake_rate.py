"""The Mooncake wheel talking to itself on loopback: two engines (target and initiator) in
one process, ROUNDS (argv 1) batch writes of 64 blocks of 192 KiB (12 MB, as the transfer
bench's regions) from one to the other, best of 3 passes. Prints one JSON line: GB/s."""
import ctypes, json, sys, time

from mooncake.engine import TransferEngine

rounds = int(sys.argv[1])
RUNS, RUN = 64, 192 << 10
size = RUNS * RUN

def engine():
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return te

target, initiator = engine(), engine()
dst = (ctypes.c_ubyte * size)()
src = (ctypes.c_ubyte * size)(*([7] * size))
dst_addr, src_addr = ctypes.addressof(dst), ctypes.addressof(src)
assert target.register_memory(dst_addr, size) == 0
assert initiator.register_memory(src_addr, size) == 0
session = f"127.0.0.1:{target.get_rpc_port()}"
offs = [i * RUN for i in range(RUNS)]
srcs, dsts, lens = [src_addr + o for o in offs], [dst_addr + o for o in offs], [RUN] * RUNS
assert initiator.batch_transfer_sync_write(session, srcs, dsts, lens) == 0  # warm-up
best = 0.0
for _ in range(3):
    t = time.perf_counter()
    for _ in range(rounds):
        assert initiator.batch_transfer_sync_write(session, srcs, dsts, lens) == 0
    best = max(best, rounds * size / (time.perf_counter() - t) / 1e9)
print(json.dumps({"gbps": best}), flush=True)
