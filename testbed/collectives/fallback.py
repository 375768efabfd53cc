"""A job's host fallback aggregator (ATP style): the rounds its switch cannot hold.

In shared mode (``placement.mode = "shared"``) each round of a job's slots claims an entry of
the switch's shared pool when it starts; a round whose entries other rounds hold is sent here
instead (so a slot's rounds may alternate between the switch and here, and this aggregator's
job runs in ``fallback`` mode: a round may skip ahead of the last one it saw): the switch
readdresses those contributions to this aggregator, from its own identity (the member it
checked stays in the header's ``worker_id``; the host of a worker would drop a packet carrying
its own address as source). This aggregator runs the same aggregation kernel as the switch
(:mod:`testbed.kernels.aggregation`) on a UDP socket of one of the job's hosts: it takes
datagrams from its switch only, gives each the registered address of the member its header
names (so the kernel's membership check holds as on the switch), and answers the workers
directly; the workers accept RESULTs from their switch and from here. Exactly-once holds as at
the switch: the same rounds, the same members.

On a tree (every tree switch in shared mode, each with fallbacks of its own on the hosts below
it) the fallback of a switch below the root is that switch for the rounds it could not hold:
its job has the switch as parent, so a completed round's partial sum goes to the switch, which
relays it up as its own, and the parent's RESULT comes back relayed by the switch (F3 in
``docs/protocol.md``). The fallback of a switch whose members are switches sends its RESULTs to
its switch too, which relays each to the member it names: a member switch takes RESULTs from
its parent only.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import sys

import numpy as np

from testbed.kernels.aggregation import MAX_ELEMS_MTU, Aggregation, Batch4, Member, Peer
from testbed.kernels.packets import PORT_UNSET, write_eth_ip_udp
from testbed.kernels.wire import (
    FIELD_OFFSETS,
    FRAME_MAX,
    HEADER_LEN,
    HEADER_OFFSET,
    TESTBED_UDP_PORT,
    Codec,
    MsgType,
)

BURST = 64
WORKER_ID = FIELD_OFFSETS["worker_id"]
MSG_TYPE = FIELD_OFFSETS["msg_type"]


def _mac(s: str) -> bytes:
    return bytes(int(p, 16) for p in s.split(":"))


def _ip(s: str) -> int:
    return int.from_bytes(socket.inet_aton(s), "big")


def warm_up() -> None:
    """Load (or compile once) the aggregation kernel with the argument types the fallback uses,
    so that a process forking the fallbacks loads it once for all of them and no timed
    collective pays for it (loading it costs a loaded machine around a second)."""
    table = Aggregation(memory_bytes=4 * 2 * 256, pool_entries=0, pool_lanes=1, max_slots=1,
                        max_elems=MAX_ELEMS_MTU)
    table.process(_batch(1), 0)


def _batch(cap: int) -> Batch4:
    return Batch4(np.zeros((cap, FRAME_MAX), np.uint8), np.zeros(cap, np.int32),
                  np.zeros(cap, np.int16), np.full(cap, PORT_UNSET, np.int16),
                  np.zeros(cap, np.uint8))


class HostAggregator:
    """The fallback aggregator of one job (``job["fallback"]`` of the collectives runner:
    ``ip``, ``mac``, ``port``, ``slots``, ``seq0``, ``lanes``, ``members``, and ``switch_ip``:
    the switch whose pool it backs, the only source it takes datagrams from; on a tree also
    ``switch_mac``, ``parent_index`` (below the root: the switch's member id at its parent)
    and ``results_via_switch`` (its members are switches))."""

    def __init__(self, job_id: int, fb: dict):
        lanes, slots = int(fb["lanes"]), int(fb["slots"])
        self.table = Aggregation(memory_bytes=max(slots * 2 * lanes * 4, 4), pool_entries=0,
                                 pool_lanes=1, max_slots=slots, max_elems=MAX_ELEMS_MTU)
        ok = np.zeros(256, np.bool_)
        ok[[int(Codec.INT32), int(Codec.THC)]] = True
        self.mac, self.ip = _mac(fb["mac"]), _ip(fb["ip"])
        self.table.set_identity(mac=self.mac, ip=self.ip, codec_ok=ok, via_ingress=True)
        members = [Member(int(m["worker"]), _mac(m["mac"]), _ip(m["ip"]), int(m["port"]), 0)
                   for m in fb["members"]]
        self.switch_ip = _ip(fb["switch_ip"])
        self.switch_mac = _mac(fb.get("switch_mac", "00:00:00:00:00:00"))
        parent = None
        if fb.get("parent_index") is not None:  # the switch is this job's parent (see above)
            parent = Peer(self.switch_mac, self.switch_ip, 0, 0, int(fb["parent_index"]))
        self.table.add_job(job_id, slots, members, int(fb["seq0"]), lanes=lanes,
                           fallback_host=True, parent=parent)
        self.via_switch = (socket.inet_ntoa(self.switch_ip.to_bytes(4, "big")),
                           TESTBED_UDP_PORT) if fb.get("results_via_switch") else None
        self.member_addr = {m.worker: m for m in members}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((fb["ip"], int(fb.get("port", TESTBED_UDP_PORT))))
        self.sock.setblocking(False)
        cap = BURST * (1 + len(members))
        self.b = _batch(cap)
        self.dgram = bytearray(FRAME_MAX)
        self.sent = self.foreign = 0
        self.table.process(self.b, 0)  # load the kernel now, not in the job's first host round

    def poll_once(self) -> int:
        """Take the datagrams waiting (up to a burst), aggregate them, send what completes;
        return how many were taken."""
        b, k = self.b, 0
        view = memoryview(self.dgram)
        while k < BURST:
            try:
                size, (src, sport) = self.sock.recvfrom_into(view)
            except BlockingIOError:
                break
            if size < HEADER_LEN or size > FRAME_MAX - HEADER_OFFSET:
                continue
            if _ip(src) != self.switch_ip or sport != TESTBED_UDP_PORT:
                self.foreign += 1  # not from our switch: never counted
                continue
            if self.dgram[MSG_TYPE] == MsgType.RESULT:  # the parent's, relayed by the switch
                mac, ip, port = self.switch_mac, self.switch_ip, TESTBED_UDP_PORT
            else:
                member = int.from_bytes(self.dgram[WORKER_ID:WORKER_ID + 2], "little")
                m = self.member_addr.get(member)
                if m is None:  # no member of the job
                    self.foreign += 1
                    continue
                mac, ip, port = m.mac, m.ip, m.port
            b.length[k] = write_eth_ip_udp(b.buf[k], np.frombuffer(mac, np.uint8),
                                           np.frombuffer(self.mac, np.uint8), ip, self.ip,
                                           port, TESTBED_UDP_PORT, size - HEADER_LEN)
            b.buf[k, HEADER_OFFSET:HEADER_OFFSET + size] = np.frombuffer(view[:size], np.uint8)
            b.in_port[k], b.out_port[k], b.reason[k] = 0, PORT_UNSET, 0
            k += 1
        if k == 0:
            return 0
        n = self.table.process(b, k)
        for i in range(k, n):
            f = b.buf[i]
            to = (socket.inet_ntoa(f[30:34].tobytes()), (int(f[36]) << 8) | int(f[37]))
            if self.via_switch is not None and f[HEADER_OFFSET + MSG_TYPE] == MsgType.RESULT:
                to = self.via_switch  # the switch relays it to the member it names
            try:
                self.sock.sendto(f[HEADER_OFFSET:b.length[i]].tobytes(), to)
                self.sent += 1
            except BlockingIOError:
                pass  # the worker retransmits; its round is answered again
        return k

    def serve(self, stop_fd: int) -> dict:
        """Serve until ``stop_fd`` becomes readable (or closes); return the counters."""
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ, "data")
        sel.register(stop_fd, selectors.EVENT_READ, "stop")
        try:
            while True:
                events = sel.select(1.0)
                if any(key.data == "stop" for key, _ in events):
                    while self.poll_once():
                        pass
                    return self.counters()
                while self.poll_once() == BURST:
                    pass
        finally:
            sel.close()

    def counters(self) -> dict:
        """The aggregation's counters (``completed``: rounds aggregated here)."""
        out = self.table.counters()
        out["results_sent_host"] = self.sent
        out["foreign"] = self.foreign
        return out

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


def serve_main() -> int:
    """``python -m testbed.collectives.fallback``: serve the host fallback aggregators of a
    job whose ranks run outside the collectives' pool (a training job's, a launched one's:
    :func:`testbed.collectives.runner.host_fallbacks`). Reads one JSON line from standard
    input (``job_id``, ``timeout_s``, ``fallbacks``: the registration's), forks them as the
    pool does (each in its host's namespace, dying with this process), says ``{"type":
    "ready"}`` (or ``"error"``) on standard output, serves until standard input closes, then
    writes their summed counters as one JSON line."""
    from testbed.collectives.spec import CollectiveSpec
    from testbed.collectives.worker import _start_fallbacks, _stop_fallbacks
    from testbed.lifeline import follow_owner

    follow_owner()  # the fallbacks go with this process: they hold PR_SET_PDEATHSIG
    warm_up()  # before the order: a process started ahead of need is ready when it comes
    line = sys.stdin.readline()
    if not line:
        return 0  # a spare never used (its control plane closed it)
    order = json.loads(line)
    spec = CollectiveSpec(op="allreduce", algo="ina", nbytes=4, job_id=int(order["job_id"]),
                          timeout_s=float(order.get("timeout_s", 30.0)))
    job = {"fallbacks": order["fallbacks"], "_pool_pid": os.getpid()}
    try:
        started = _start_fallbacks(job, spec)
    except Exception as e:  # noqa: BLE001 - reported to the control plane, which raises it
        print(json.dumps({"type": "error", "error": str(e)}), flush=True)
        return 2
    print(json.dumps({"type": "ready"}), flush=True)
    sys.stdin.read()  # until the control plane closes it (or dies)
    result: dict = {}
    _stop_fallbacks(started, result)
    print(json.dumps({"type": "counters", "counters": result.get("fallback", {})}), flush=True)
    sys.stdout.close()
    os._exit(0)  # its fallbacks are reaped: no interpreter teardown for the caller to wait on


if __name__ == "__main__":
    sys.exit(serve_main())
