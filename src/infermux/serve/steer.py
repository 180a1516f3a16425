"""New gRPC connections to the least loaded front process, and old ones re-placed over time.

Front processes share the gRPC port through SO_REUSEPORT, and the kernel hands each new
connection to one of their listening sockets by a hash of its addresses and ports. A gRPC
client multiplexes many calls over few connections (perf_analyzer opens about one per five
concurrent requests), so the hash's spread is the load's: at concurrency 64 eight fronts held
twelve connections as `[2, 0, 0, 3, 1, 3, 2, 1]`, and each front's cores followed its count,
the busiest near one core of its own while others idled (docs/benchmarks.md).

A socket of a SO_REUSEPORT group may carry a classic BPF program that picks the group's
socket for each new connection (`SO_ATTACH_REUSEPORT_CBPF`, Linux 4.5; no privilege needed,
unlike an eBPF program). Each front counts the gRPC connections its inference calls came on
over the last 0.1–0.2 s (`proxy.PEER_TICKS`) and reports the count with every state the
runtime process pushes (0.1 s), and at once when a call comes on a new connection; the
runtime process has a front attach a program that draws the socket among the fronts with
fewest (`weights`), so a new connection goes where there are fewest. Connections, not
requests: a front that is the bottleneck takes as many requests a second as any other (its
own core's worth) while the calls of its extra connections wait in it.

A program cannot move a connection already made. With `--connection-age` (off by default:
no gain in requests/s or p99 was shown, docs/architecture-serve.md) the fronts' gRPC servers
close connections after about that long (the server sends GOAWAY, lets the calls in flight
finish, and the client reconnects: grpc's `max_connection_age`, jittered by ±10%), and each
reconnection is placed by the program of that moment.

A socket's index in the group is the order in which the listening sockets joined it: the
runtime process lets the fronts open their gRPC ports one after another, and when a front's
socket leaves the group the kernel moves the last socket into its place (`Steering.leave`).
An index past the group's end makes the kernel fall back to its hash, so a stale picture costs
balance, never a connection.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["Steering", "attach", "listening_sockets", "program", "weights"]

SO_ATTACH_REUSEPORT_CBPF = 51

# Classic BPF opcodes (linux/filter.h, linux/bpf_common.h).
_LD_W_ABS = 0x00 | 0x00 | 0x20
_ALU_MOD_K = 0x04 | 0x90 | 0x00
_JGE_K = 0x05 | 0x30 | 0x00
_RET_K = 0x06 | 0x00
#: The ancillary load of a random 32-bit number (SKF_AD_OFF + SKF_AD_RANDOM).
_RANDOM = (-0x1000 + 56) & 0xFFFFFFFF
#: The draw's resolution: weights are rounded to 1/_SCALE of their sum.
_SCALE = 1024


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Insn))]


def weights(loads: Sequence[float]) -> list[float]:
    """Each front's share of new connections, from its load (its connections with calls).

    The fronts with the fewest share alike, the others get none. Each front reports a new
    connection the moment its first call arrives, and the runtime process sends a new table
    on that report, so connections made one after another (the server's own re-placing, spread
    over `--connection-age`'s jitter) each go to the front with fewest at that moment. A burst
    faster than that (a client's first connections) is drawn at random among those fronts,
    as the kernel's hash would, and re-placed as the connections age.
    """
    low = min(loads, default=0.0)
    return [1.0 if x <= low else 0.0 for x in loads]


def program(indices: Sequence[int], shares: Sequence[float]) -> list[tuple[int, int, int, int]]:
    """A classic BPF program that returns socket index `indices[i]` with weight `shares[i]`.

    A random number modulo `_SCALE`, compared with the shares' running sums: one compare and
    one return per socket with a share, the last one unconditional.
    """
    pairs = [(i, w) for i, w in zip(indices, shares, strict=True) if w > 0]
    if not pairs:
        raise ValueError("no socket has a share")
    total = sum(w for _, w in pairs)
    insns = [(_LD_W_ABS, 0, 0, _RANDOM), (_ALU_MOD_K, 0, 0, _SCALE)]
    bound = 0.0
    for index, w in pairs[:-1]:
        bound += _SCALE * w / total
        insns += [(_JGE_K, 1, 0, round(bound)), (_RET_K, 0, 0, index)]
    insns.append((_RET_K, 0, 0, pairs[-1][0]))
    return insns


def attach(sock: socket.socket, insns: Sequence[tuple[int, int, int, int]]) -> None:
    """Attach `insns` to the SO_REUSEPORT group `sock` listens in (replacing its program)."""
    array = (_Insn * len(insns))(*[_Insn(*i) for i in insns])
    prog = _Prog(len(insns), ctypes.cast(array, ctypes.POINTER(_Insn)))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF,
                    ctypes.string_at(ctypes.addressof(prog), ctypes.sizeof(prog)))


def listening_sockets(port: int) -> list[socket.socket]:
    """The TCP sockets of this process listening on `port` (duplicates: close when done).

    For a server that opens its own (grpc's): its sockets are found among the process's files,
    each once however many descriptors it has (grpc holds its listener under several).
    """
    found: list[socket.socket] = []
    inodes: set[int] = set()
    if not sys.platform.startswith("linux"):
        return found
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        keep = False
        with contextlib.suppress(OSError):
            keep = (sock.type == socket.SOCK_STREAM
                    and bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
                    and sock.getsockname()[1] == port
                    and os.fstat(sock.fileno()).st_ino not in inodes)
        if keep:
            inodes.add(os.fstat(sock.fileno()).st_ino)
            found.append(sock)
        else:
            sock.close()
    return found


class Steering:
    """The runtime process's picture of the gRPC port's group: which front is at which index.

    `members` lists the fronts (any hashable) in the order of their sockets in the group.
    """

    def __init__(self) -> None:
        self.members: list[Any] = []
        self.version = 0

    def join(self, member: Any) -> None:
        """`member`'s socket joined the group (it listens): it is the last."""
        self.members.append(member)
        self.version += 1

    def leave(self, member: Any) -> None:
        """`member`'s socket left: the kernel moves the last socket into its place."""
        if member not in self.members:
            return
        at = self.members.index(member)
        last = self.members.pop()
        if at < len(self.members):
            self.members[at] = last
        self.version += 1

    def table(self, loads: dict[Any, float]) -> list[list[float]] | None:
        """[[socket index, share], ...] for the members' `loads`; None with fewer than two."""
        if len(self.members) < 2:
            return None
        shares = weights([loads.get(m, 0.0) for m in self.members])
        total = sum(shares)
        return [[i, round(w / total, 4)] for i, w in enumerate(shares)]
