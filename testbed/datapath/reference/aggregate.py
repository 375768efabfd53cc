"""Plain-Python twin of :mod:`testbed.datapath.aggregate` (per packet, dict state).

``AggregateReference(agg_mac, agg_ip, jobs).process(frame, in_port)`` returns
``(decision, reason, emitted)``: decision an out port or ``PORT_*``, reason a ``DropReason`` (0
unless dropped), emitted a list of ``(out_port, frame bytes)`` (RESULTs, partial sums sent up a
tree) in the order the kernel appends them; a contribution forwarded to a host fallback is the
decision (its port) with the frame rewritten in ``self.last_frame``. ARP is not modelled.
``jobs`` is the stage's ``jobs`` setting with port indices for ``ingress``/``egress``; the
shared pool is ``pool_entries`` entries of ``pool_lanes`` lanes (one register set each),
claimed by a round when it starts and given back once every member has its result.
"""

from __future__ import annotations

import struct

import numpy as np

from testbed.datapath.batch import PORT_DROP, PORT_HELD, PORT_UNSET
from testbed.kernels import wire
from testbed.kernels.aggregation import MAX_ELEMS_MTU, POOL_PROBES, THC_MAX_ELEMS
from testbed.kernels.reference.packets import ipv4_checksum, parse_frame, udp_frame
from testbed.kernels.wire import Codec, DropReason, Flags, MsgType

R = DropReason
SEQ = 1 << 32


def _ip(s: str) -> bytes:
    return bytes(int(p) for p in s.split("."))


def _mac(s: str) -> bytes:
    return bytes(int(p, 16) for p in s.split(":"))


def _diff(a: int, b: int) -> int:
    d = (a - b) % SEQ
    return d - SEQ if d >= SEQ // 2 else d


def result_lanes(codec: int, values: np.ndarray) -> tuple[str | None, int]:
    """(numpy lane type or None, flags) of a sum sent on: int32 unless THC, whose sums go out
    in the narrowest of int8/int16/int32 that holds them all and fits the MTU, else OVERFLOW."""
    if codec != Codec.THC:
        return "<i4", 0
    lo, hi = (int(values.min()), int(values.max())) if values.size else (0, 0)
    for t, size in (("<i1", 1), ("<i2", 2), ("<i4", 4)):
        info = np.iinfo(np.dtype(t))
        if info.min <= min(lo, 0) and max(hi, 0) <= info.max and size * values.size <= \
                wire.MTU_PAYLOAD:
            return t, 0
    return None, int(Flags.OVERFLOW)


def _pool_index(job_id: int, slot: int, seq: int, probe: int, entries: int) -> int:
    m = (1 << 64) - 1
    h = ((job_id << 48) ^ (slot << 32) ^ seq) & m
    h ^= (probe * 0x9E3779B97F4A7C15) & m
    h = ((h ^ (h >> 33)) * 0xFF51AFD7ED558CCD) & m
    h = ((h ^ (h >> 33)) * 0xC4CEB9FE1A85EC53) & m
    return (h ^ (h >> 33)) % entries


class AggregateReference:
    """Per-packet model of the aggregate stage (see the module docstring)."""

    def __init__(self, agg_mac: str, agg_ip: str, jobs: dict, max_elems: int = MAX_ELEMS_MTU,
                 codecs=(Codec.INT32, Codec.THC), via_ingress: bool = True,
                 pool_entries: int = 0, pool_lanes: int = 256):
        self.mac, self.ip = _mac(agg_mac), _ip(agg_ip)
        self.max_elems = max_elems
        self.codecs = {int(c) for c in codecs}
        self.via_ingress = via_ingress
        self.pool_entries, self.pool_lanes = pool_entries, pool_lanes
        self.pool: dict[int, tuple] = {}  # entry -> (job, slot, set) of the round holding it
        self.jobs: dict[int, dict] = {}
        self.rounds: dict[tuple[int, int, int], dict] = {}  # (job, slot, set) -> round
        self.last_frame = b""
        for jid, spec in jobs.items():
            self.add_job(int(jid), spec)

    def add_job(self, job_id: int, spec: dict) -> None:
        """Register a job and put its slots before ``seq0``."""
        members = {int(m["worker"]): (_mac(m["mac"]), _ip(m["ip"]), int(m["port"]),
                                      int(m["ingress"])) for m in spec["members"]}
        parent = spec.get("parent")
        fb = spec.get("fallback")
        self.pool = {e: o for e, o in self.pool.items() if o[0] != job_id}
        mode = spec.get("mode", "static")
        self.jobs[job_id] = {
            "slots": int(spec["slots"]), "members": members, "lanes": int(spec.get("lanes", 256)),
            "shared": mode == "shared", "follows": mode == "fallback",
            "parent": None if parent is None else (_mac(parent["mac"]), _ip(parent["ip"]),
                                                   int(parent["egress"]), int(parent["index"])),
            "fallback": [(_mac(x["mac"]), _ip(x["ip"]), int(x["port"]), int(x["egress"]),
                          int(x.get("ingress", x["egress"])))
                         for x in ([] if fb is None else fb if isinstance(fb, list) else [fb])]}
        seq0 = int(spec.get("seq0", 0))
        for k in range(int(spec["slots"])):
            for back in (2, 1):
                r = (seq0 - back) % SEQ
                self.rounds[(job_id, k, r & 1)] = {"seq": r, "counted": set(), "state": "done"}

    # ------------------------------------------------------------------------------------
    def process(self, f: bytes, in_port: int):
        """Apply one frame; see the module docstring."""
        if len(f) < 14:
            return PORT_UNSET, 0, []
        to_ip = len(f) >= 34 and f[12:14] == b"\x08\x00" and f[30:34] == self.ip
        if f[0:6] != self.mac and not to_ip:
            return PORT_UNSET, 0, []
        status, _hdr = parse_frame(np.frombuffer(f, np.uint8), len(f))
        h = wire.unpack_header(f, wire.HEADER_OFFSET) if not status else None
        if h is not None:
            job = self.jobs.get(int(h["job_id"]))
            if job is not None and job["shared"] and self._from_fallback(f, in_port, job,
                                                                         int(h["slot"])):
                return self._from_host(f, h, job)
        if h is not None and int(h["msg_type"]) == MsgType.RESULT:
            job = self.jobs.get(int(h["job_id"]))
            if job is not None and self._from_parent(f, in_port, job):
                return self._parent_result(f, h, job)
        if status:
            return PORT_DROP, int(status), []
        payload = f[wire.PAYLOAD_OFFSET:14 + int.from_bytes(f[16:18], "big")]
        if int(h["msg_type"]) not in (MsgType.DATA, MsgType.RETRANSMIT):
            return PORT_DROP, R.UNKNOWN_TYPE, []
        codec = int(h["codec"])
        if codec not in self.codecs:
            return PORT_DROP, R.BAD_CODEC, []
        ne, flags = int(h["elem_count"]), int(h["flags"])
        thc = codec == Codec.THC
        overflowed = thc and flags & Flags.OVERFLOW and not payload
        lane = len(payload) // ne if ne and len(payload) % ne == 0 else 0
        lim = THC_MAX_ELEMS if thc else self.max_elems
        if not 0 < ne <= lim or not (overflowed or lane == 4 or (thc and lane in (1, 2))):
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
        vals = None if overflowed else np.frombuffer(payload, {1: "<i1", 2: "<i2", 4: "<i4"}[lane]
                                                     ).astype(np.int64)
        return self._contribute(f, h, job, jid, w, r, slot, ne, vals)

    def _contribute(self, f, h, job, jid, w, r, slot, ne, vals):
        here = self.rounds[(jid, slot, r & 1)]
        other = self.rounds[(jid, slot, 1 - (r & 1))]
        d = _diff(r, here["seq"])
        if d == 0:
            if here["state"] == "host":
                self._seen(jid, slot, r & 1, w, job)
                return self._fallback(f, job, slot)
            if w in here["counted"]:
                if here["state"] == "done":
                    if job["shared"] and here.get("entry") is None:  # everyone has the result
                        return PORT_DROP, R.STALE, []
                    return PORT_HELD, 0, [self._result(jid, slot, here, w)]
                if here["state"] == "up":  # T2: one resend up answers every member asking
                    asked = here.setdefault("asked", set())
                    if asked and w not in asked:
                        asked.add(w)
                        return PORT_DROP, R.DUPLICATE, []
                    here["asked"] = {w}
                    return PORT_HELD, 0, [self._upward(jid, slot, here, MsgType.RETRANSMIT)]
                return PORT_DROP, R.DUPLICATE, []
            if here["state"] != "open":
                return PORT_DROP, R.STALE, []
        elif d == 2 and not job["follows"]:
            if (here["state"] not in ("done", "host") or other["state"] not in ("done", "host")
                    or other["seq"] != (r - 1) % SEQ):
                return PORT_DROP, R.BAD_SEQ, []
        elif d > 0 and job["follows"]:  # a host fallback: the switch summed the rounds between
            if here["state"] != "done":
                return PORT_DROP, R.BAD_SEQ, []
        else:
            return PORT_DROP, (R.STALE if d < 0 else R.BAD_SEQ), []
        if ne > job["lanes"]:
            return PORT_DROP, R.BAD_LENGTH, []
        if d != 0:
            here["seq"] = r
            if job["shared"]:
                self._release(jid, slot, r & 1)
                if not self._claim(jid, slot, r):
                    here.update(state="host", counted=set())  # members seen passing
                    self._seen(jid, slot, r & 1, w, job)
                    return self._fallback(f, job, slot)
            here.update(state="open", counted={w}, values=vals, ne=ne, overflow=vals is None,
                        chunk=int(h["chunk_offset"]), codec=int(h["codec"]),
                        exp=int(h["exponent"]))
        else:
            if (here["ne"], here["chunk"]) != (ne, int(h["chunk_offset"])):
                return PORT_DROP, R.ELEM_MISMATCH, []
            if here["codec"] != int(h["codec"]):
                return PORT_DROP, R.BAD_CODEC, []
            if vals is None:
                here["overflow"] = True
            elif here["values"] is None:
                here["values"] = vals
            else:
                here["values"] = here["values"] + vals
            here["exp"] = max(here["exp"], int(h["exponent"]))
            here["counted"].add(w)
        if len(here["counted"]) < len(job["members"]):
            return PORT_HELD, 0, []
        if job["shared"]:  # every member had the previous round's result
            self._release_previous(jid, slot, r)
        if job["parent"] is not None:
            here.update(state="up", asked=set())
            return PORT_HELD, 0, [self._upward(jid, slot, here, MsgType.DATA)]
        here["state"] = "done"
        return PORT_HELD, 0, [self._result(jid, slot, here, v) for v in sorted(job["members"])]

    def _claim(self, jid: int, slot: int, r: int) -> bool:
        for k in range(POOL_PROBES):
            e = _pool_index(jid, slot, r, k, self.pool_entries)
            if e not in self.pool:
                self.pool[e] = (jid, slot, r & 1)
                self.rounds[(jid, slot, r & 1)]["entry"] = e
                return True
        return False

    def _release(self, jid: int, slot: int, s: int) -> None:
        rnd = self.rounds[(jid, slot, s)]
        e = rnd.get("entry")
        if e is not None and self.pool.get(e) == (jid, slot, s):
            del self.pool[e]
        rnd["entry"] = None

    def _seen(self, jid: int, slot: int, s: int, w: int, job: dict) -> None:
        """A member's contribution to a host round passed: once all did, the previous round's
        result is needed no more."""
        here = self.rounds[(jid, slot, s)]
        if len(here["counted"]) == len(job["members"]):
            return  # a duplicate: the previous round was released already (or moved on)
        here["counted"].add(w)
        if len(here["counted"]) == len(job["members"]):
            self._release_previous(jid, slot, here["seq"])

    def _release_previous(self, jid: int, slot: int, r: int) -> None:
        if self.rounds[(jid, slot, 1 - (r & 1))]["seq"] == (r - 1) % SEQ:
            self._release(jid, slot, 1 - (r & 1))

    def _readdress(self, f: bytes, mac: bytes, ip: bytes, port: int) -> bytearray:
        """``f`` as this aggregator's packet to ``mac``/``ip``/``port``."""
        g = bytearray(f)
        g[0:6], g[30:34] = mac, ip
        g[6:12], g[26:30] = self.mac, self.ip
        g[34:36] = wire.TESTBED_UDP_PORT.to_bytes(2, "big")
        g[36:38], g[40:42] = port.to_bytes(2, "big"), b"\0\0"
        g[24:26] = b"\0\0"
        g[24:26] = ipv4_checksum(bytes(g[14:34])).to_bytes(2, "big")
        return g

    def _fallback(self, f: bytes, job: dict, slot: int):
        if not job["fallback"]:
            return PORT_DROP, R.NO_ROUTE, []
        mac, ip, port, egress, _ = job["fallback"][slot % len(job["fallback"])]
        # from the switch: the member is in the header
        self.last_frame = bytes(self._readdress(f, mac, ip, port))
        return egress, 0, []

    def _from_fallback(self, f: bytes, in_port: int, job: dict, slot: int) -> bool:
        if not job["fallback"]:
            return False
        mac, ip, port, _, ingress = job["fallback"][slot % len(job["fallback"])]
        return (in_port, f[6:12], f[26:30], int.from_bytes(f[34:36], "big")) == (
            ingress, mac, ip, port)

    def _from_host(self, f: bytes, h, job: dict):
        """The host fallback's packet of a round it summed for this node, relayed: a partial
        sum up to the parent, a RESULT down to the member switch it names."""
        jid, slot, r = int(h["job_id"]), int(h["slot"]), int(h["seq"])
        if slot >= job["slots"] or int(h["slot_set"]) != r & 1:
            return PORT_DROP, R.BAD_SLOT, []
        here = self.rounds[(jid, slot, r & 1)]
        if here["state"] != "host" or here["seq"] != r:
            return PORT_DROP, R.STALE, []
        if int(h["msg_type"]) == MsgType.RESULT:
            w = int(h["worker_id"])
            if w not in job["members"]:
                return PORT_DROP, R.BAD_WORKER, []
            mac, ip, port, ingress = job["members"][w]
            self.last_frame = bytes(self._readdress(f, mac, ip, port))
            return (ingress if self.via_ingress else PORT_UNSET), 0, []
        if job["parent"] is None:
            return PORT_DROP, R.NO_ROUTE, []
        mac, ip, egress, index = job["parent"]
        g = self._readdress(f, mac, ip, wire.TESTBED_UDP_PORT)
        o = wire.HEADER_OFFSET + wire.FIELD_OFFSETS["worker_id"]
        g[o:o + 2] = index.to_bytes(2, "little")
        self.last_frame = bytes(g)
        return egress, 0, []

    def _from_parent(self, f: bytes, in_port: int, job: dict) -> bool:
        p = job["parent"]
        return (p is not None and in_port == p[2] and f[6:12] == p[0] and f[26:30] == p[1]
                and int.from_bytes(f[34:36], "big") == wire.TESTBED_UDP_PORT)

    def _parent_result(self, f: bytes, h, job: dict):
        jid, slot, r = int(h["job_id"]), int(h["slot"]), int(h["seq"])
        if slot >= job["slots"] or int(h["slot_set"]) != r & 1:
            return PORT_DROP, R.BAD_SLOT, []
        here = self.rounds[(jid, slot, r & 1)]
        if here["state"] == "host" and here["seq"] == r:  # summed by the host: its result
            return self._fallback(f, job, slot)
        d = _diff(r, here["seq"])
        if d < 0:
            return PORT_DROP, R.STALE, []
        if d == 0 and here["state"] == "done":
            return PORT_DROP, R.DUPLICATE, []
        if d != 0 or here["state"] != "up":
            return PORT_DROP, R.BAD_SEQ, []
        ne = int(h["elem_count"])
        if (ne, int(h["chunk_offset"]), int(h["codec"])) != (here["ne"], here["chunk"],
                                                             here["codec"]):
            return PORT_DROP, R.ELEM_MISMATCH, []
        data = f[wire.PAYLOAD_OFFSET:14 + int.from_bytes(f[16:18], "big")]
        ovf = bool(int(h["flags"]) & Flags.OVERFLOW)
        lane = len(data) // ne if ne and len(data) % ne == 0 else 0
        if not ovf and not (lane == 4 or (here["codec"] == Codec.THC and lane in (1, 2))):
            return PORT_DROP, R.BAD_LENGTH, []
        here["overflow"] = ovf
        if not ovf:
            here["values"] = np.frombuffer(data, {1: "<i1", 2: "<i2", 4: "<i4"}[lane]).astype(
                np.int64)
        here["exp"] = int(h["exponent"])
        here["state"] = "done"
        return PORT_HELD, 0, [self._result(jid, slot, here, v) for v in sorted(job["members"])]

    # ------------------------------------------------------------------------------------
    def _sum_bytes(self, rnd: dict) -> tuple[bytes, int]:
        if rnd["overflow"]:
            return b"", int(Flags.OVERFLOW)
        # int32 registers wrap like a switch ALU
        regs = ((rnd["values"] + (1 << 31)) % (1 << 32) - (1 << 31)).astype(np.int64)
        lane_t, flags = result_lanes(rnd["codec"], regs)
        return (regs.astype(lane_t).tobytes() if lane_t else b""), flags

    def _packet(self, msg_type, jid, w, slot, rnd, dst_mac, dst_ip, dst_port) -> bytes:
        data, flags = self._sum_bytes(rnd)
        hdr = wire.pack_header(msg_type=int(msg_type), job_id=jid, worker_id=w, slot=slot,
                               slot_set=rnd["seq"] & 1, flags=flags, codec=rnd["codec"],
                               n_workers=len(self.jobs[jid]["members"]), exponent=rnd["exp"],
                               elem_count=rnd["ne"], chunk_offset=rnd["chunk"], seq=rnd["seq"])
        return udp_frame(self.mac, dst_mac, self.ip, dst_ip, wire.TESTBED_UDP_PORT, dst_port,
                         hdr + data)

    def _result(self, jid: int, slot: int, rnd: dict, w: int) -> tuple[int, bytes]:
        mac, ip, port, ingress = self.jobs[jid]["members"][w]
        frame = self._packet(MsgType.RESULT, jid, w, slot, rnd, mac, ip, port)
        return (ingress if self.via_ingress else PORT_UNSET), frame

    def _upward(self, jid: int, slot: int, rnd: dict, msg_type) -> tuple[int, bytes]:
        mac, ip, egress, index = self.jobs[jid]["parent"]
        return egress, self._packet(msg_type, jid, index, slot, rnd, mac, ip,
                                    wire.TESTBED_UDP_PORT)
