"""The Mooncake wheel as an initiator against a target at SESSION (argv 1) whose region starts
at BASE (argv 2) and is LEN bytes long (argv 3). Writes a deterministic pattern with the
wheel's own calls and prints one JSON line of return codes and the sha256 of what it sent."""
import ctypes, hashlib, json, sys

from mooncake.engine import TransferEngine

session, base, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ONE, BLOCK, BLOCKS = 1 << 20, 8 << 10, 8
assert length >= ONE + BLOCK * BLOCKS

te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
src = (ctypes.c_ubyte * length).from_buffer(bytearray((i * 31 + 7) % 251 for i in range(length)))
addr = ctypes.addressof(src)
rc = {}
rc["probe"] = te.send_probe(session)
rc["write"] = te.transfer_sync_write(session, addr, base, ONE)
offs = [ONE + k * BLOCK for k in range(BLOCKS)]
rc["batch"] = te.batch_transfer_sync_write(
    session, [addr + o for o in offs], [base + o for o in offs], [BLOCK] * BLOCKS)
# Crosses the region's end: the target must refuse it.
rc["out_of_range"] = te.transfer_sync_write(session, addr, base + length - 32, 64)
# And the target serves the next write after a refusal (a new connection).
tail = ONE + BLOCK * BLOCKS
rc["after_refusal"] = te.transfer_sync_write(session, addr + tail, base + tail, length - tail)
sent = bytes(src)
print(json.dumps({"rc": rc, "sha256": hashlib.sha256(sent).hexdigest()}), flush=True)
