"""Plain-Python twin of :mod:`testbed.datapath.aggregate` (per packet, dict state).

``AggregateReference(agg_mac, agg_ip, jobs).process(frame, in_port)`` returns
``(decision, reason, results)``: decision an out port or ``PORT_*``, reason a ``DropReason``
(0 unless dropped), results a list of ``(out_port, frame bytes)``. ARP is not modelled.
"""

from __future__ import annotations

import struct

import numpy as np

from testbed.datapath.aggregate import MAX_ELEMS_MTU, THC_MAX_ELEMS
from testbed.datapath.batch import PORT_DROP, PORT_HELD, PORT_UNSET
from testbed.kernels import wire
from testbed.kernels.reference.packets import parse_frame, udp_frame
from testbed.kernels.wire import Codec, DropReason, MsgType

R = DropReason


def _ip(s: str) -> bytes:
    return bytes(int(p) for p in s.split("."))


def _mac(s: str) -> bytes:
    return bytes(int(p, 16) for p in s.split(":"))


def result_lanes(codec: int, values: np.ndarray) -> tuple[str | None, int]:
    """(numpy lane type or None, flags) of a RESULT: int32 unless THC, whose sums go out in the
    narrowest of int8/int16/int32 that holds them all and fits the MTU, else OVERFLOW."""
    if codec != Codec.THC:
        return "<i4", 0
    lo, hi = (int(values.min()), int(values.max())) if values.size else (0, 0)
    for t, size in (("<i1", 1), ("<i2", 2), ("<i4", 4)):
        info = np.iinfo(np.dtype(t))
        if info.min <= min(lo, 0) and max(hi, 0) <= info.max and size * values.size <= \
                wire.MTU_PAYLOAD:
            return t, 0
    return None, int(wire.Flags.OVERFLOW)


class AggregateReference:
    """Per-packet model of the aggregate stage; ``jobs`` as the stage's ``jobs`` setting but
    with ``ingress`` given as port indices."""

    def __init__(self, agg_mac: str, agg_ip: str, jobs: dict, max_elems: int = MAX_ELEMS_MTU,
                 codecs=(Codec.INT32, Codec.THC), via_ingress: bool = True):
        self.mac, self.ip = _mac(agg_mac), _ip(agg_ip)
        self.max_elems = max_elems
        self.codecs = {int(c) for c in codecs}
        self.via_ingress = via_ingress
        self.jobs: dict[int, dict] = {}
        self.rounds: dict[tuple[int, int, int], dict] = {}  # (job, slot, set) -> round state
        for jid, spec in jobs.items():
            self.add_job(int(jid), spec)

    def add_job(self, job_id: int, spec: dict) -> None:
        """Register a job (``slots``, ``seq0``, ``members``) and put its slots before ``seq0``."""
        members = {int(m["worker"]): (_mac(m["mac"]), _ip(m["ip"]), int(m["port"]),
                                      int(m["ingress"])) for m in spec["members"]}
        seq0 = int(spec.get("seq0", 0))
        self.jobs[job_id] = {"slots": int(spec["slots"]), "members": members}
        for k in range(int(spec["slots"])):
            for back in (2, 1):
                r = (seq0 - back) % (1 << 32)
                self.rounds[(job_id, k, r & 1)] = {"seq": r, "counted": set(), "missing": 0}

    def process(self, f: bytes, in_port: int):
        """Apply one frame; see the module docstring."""
        if len(f) < 14:
            return PORT_UNSET, 0, []
        to_ip = len(f) >= 34 and f[12:14] == b"\x08\x00" and f[30:34] == self.ip
        if f[0:6] != self.mac and not to_ip:
            return PORT_UNSET, 0, []
        status, _hdr = parse_frame(np.frombuffer(f, np.uint8), len(f))
        if status:
            return PORT_DROP, int(status), []
        h = wire.unpack_header(f, wire.HEADER_OFFSET)
        payload = f[wire.PAYLOAD_OFFSET:14 + int.from_bytes(f[16:18], "big")]
        if int(h["msg_type"]) not in (MsgType.DATA, MsgType.RETRANSMIT):
            return PORT_DROP, R.UNKNOWN_TYPE, []
        codec = int(h["codec"])
        if codec not in self.codecs:
            return PORT_DROP, R.BAD_CODEC, []
        ne = int(h["elem_count"])
        lane_t, lim = ("<i1", THC_MAX_ELEMS) if codec == Codec.THC else ("<i4", self.max_elems)
        if not 0 < ne <= lim or ne * np.dtype(lane_t).itemsize != len(payload):
            return PORT_DROP, R.BAD_LENGTH, []
        jid, w = int(h["job_id"]), int(h["worker_id"])
        job = self.jobs.get(jid)
        if job is None:
            return PORT_DROP, R.UNKNOWN_JOB, []
        if w not in job["members"]:
            return PORT_DROP, R.BAD_WORKER, []
        mac, ip, port, ingress = job["members"][w]
        sport = struct.unpack("!H", f[34:36])[0]
        if (f[6:12], f[26:30], sport, in_port) != (mac, ip, port, ingress):
            return PORT_DROP, R.NOT_MEMBER, []
        r, slot = int(h["seq"]), int(h["slot"])
        if slot >= job["slots"] or int(h["slot_set"]) != r & 1:
            return PORT_DROP, R.BAD_SLOT, []
        here = self.rounds[(jid, slot, r & 1)]
        other = self.rounds[(jid, slot, 1 - (r & 1))]
        d = (r - here["seq"]) % (1 << 32)
        d = d - (1 << 32) if d >= 1 << 31 else d
        vals = np.frombuffer(payload, lane_t).astype(np.int64)
        if d == 0:
            if w in here["counted"]:
                if here["missing"]:
                    return PORT_DROP, R.DUPLICATE, []
                return PORT_HELD, 0, [self._result(jid, slot, here, w)]
            if not here["missing"]:
                return PORT_DROP, R.STALE, []
            if (here["ne"], here["chunk"]) != (ne, int(h["chunk_offset"])):
                return PORT_DROP, R.ELEM_MISMATCH, []
            if here["codec"] != codec:
                return PORT_DROP, R.BAD_CODEC, []
            here["values"] = here["values"] + vals
            here["exp"] = max(here["exp"], int(h["exponent"]))
            here["missing"] -= 1
            here["counted"].add(w)
        elif d == 2:
            if here["missing"] or other["missing"] or other["seq"] != (r - 1) % (1 << 32):
                return PORT_DROP, R.BAD_SEQ, []
            here.update(seq=r, counted={w}, missing=len(job["members"]) - 1, values=vals,
                        ne=ne, chunk=int(h["chunk_offset"]), codec=codec,
                        exp=int(h["exponent"]))
        elif d < 0:
            return PORT_DROP, R.STALE, []
        else:
            return PORT_DROP, R.BAD_SEQ, []
        if here["missing"]:
            return PORT_HELD, 0, []
        return PORT_HELD, 0, [self._result(jid, slot, here, v) for v in sorted(job["members"])]

    def _result(self, jid: int, slot: int, rnd: dict, w: int) -> tuple[int, bytes]:
        """(out port, RESULT frame) of round ``rnd`` for member ``w``."""
        mac, ip, port, ingress = self.jobs[jid]["members"][w]
        # int32 registers wrap like a switch ALU
        regs = ((rnd["values"] + (1 << 31)) % (1 << 32) - (1 << 31)).astype(np.int64)
        lane_t, flags = result_lanes(rnd["codec"], regs)
        data = regs.astype(lane_t).tobytes() if lane_t else b""
        hdr = wire.pack_header(msg_type=int(MsgType.RESULT), job_id=jid, worker_id=w, slot=slot,
                               slot_set=rnd["seq"] & 1, flags=flags, codec=rnd["codec"],
                               n_workers=len(self.jobs[jid]["members"]), exponent=rnd["exp"],
                               elem_count=rnd["ne"], chunk_offset=rnd["chunk"], seq=rnd["seq"])
        frame = udp_frame(self.mac, mac, self.ip, ip, wire.TESTBED_UDP_PORT, port, hdr + data)
        return (ingress if self.via_ingress else PORT_UNSET), frame
