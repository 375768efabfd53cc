"""Packet trace of a running engine: what the next N frames were and what the program did.

Armed over the control channel (``{"cmd": "trace", "count": N}``), the engine hands every
burst to :meth:`Tracer.record` after its stages ran, until N frames are recorded; a later
``{"cmd": "trace"}`` returns them (and empties the buffer). Each record holds the ingress
port, the decision (egress port, ``flood``, ``held`` in a queue, or ``drop:<REASON>``), the
frame length and a decoded summary (Ethernet, IPv4, UDP and, for testbed packets, the header
fields by name). Only the armed bursts pay for the decoding; an idle tracer costs one integer
test per burst. This is the data path's counterpart of BMv2's packet log.
"""

from __future__ import annotations

import time

import numpy as np

from testbed.datapath.batch import PORT_DROP, PORT_FLOOD, PORT_HELD, DropReason
from testbed.kernels import wire

#: Most records an armed trace may ask for (they are kept in the engine's memory).
MAX_TRACE = 10_000


def _mac(b: np.ndarray) -> str:
    return ":".join(f"{int(x):02x}" for x in b)


def _ip(b: np.ndarray) -> str:
    return ".".join(str(int(x)) for x in b)


def describe_frame(frame: np.ndarray) -> dict:
    """Decode an Ethernet frame (uint8 array) into a flat dict of named fields."""
    out: dict = {}
    if len(frame) < wire.ETH_LEN:
        return {"error": f"runt frame ({len(frame)} B)"}
    out["eth_dst"], out["eth_src"] = _mac(frame[0:6]), _mac(frame[6:12])
    ethertype = int(frame[12]) << 8 | int(frame[13])
    out["ethertype"] = f"0x{ethertype:04x}"
    if ethertype == 0x0806:
        out["proto"] = "arp"
        return out
    if ethertype != 0x0800 or len(frame) < wire.ETH_LEN + wire.IPV4_LEN:
        return out
    ip = frame[wire.ETH_LEN:]
    ihl = (int(ip[0]) & 0x0F) * 4
    out["ip_src"], out["ip_dst"] = _ip(ip[12:16]), _ip(ip[16:20])
    proto = int(ip[9])
    out["proto"] = {1: "icmp", 6: "tcp", 17: "udp"}.get(proto, str(proto))
    l4 = wire.ETH_LEN + ihl
    if proto not in (6, 17) or len(frame) < l4 + 4:
        return out
    out["sport"] = int(frame[l4]) << 8 | int(frame[l4 + 1])
    out["dport"] = int(frame[l4 + 2]) << 8 | int(frame[l4 + 3])
    hdr_at = l4 + wire.UDP_LEN
    if proto != 17 or wire.TESTBED_UDP_PORT not in (out["sport"], out["dport"]) \
            or len(frame) < hdr_at + wire.HEADER_LEN:
        return out
    h = wire.unpack_header(frame[hdr_at:hdr_at + wire.HEADER_LEN].tobytes())
    if int(h["magic"]) != wire.MAGIC:
        return out
    out["proto"] = "testbed"
    fields = wire.describe_header(h)  # enum fields by name
    for name in ("magic", "version"):
        fields.pop(name)
    out.update(fields)
    return out


class Tracer:
    """Records summaries of the next ``count`` frames leaving the stages of an engine."""

    def __init__(self, ports: list[str]):
        self.ports = list(ports)
        self.remaining = 0
        self.records: list[dict] = []
        self._t0 = time.monotonic_ns()

    def arm(self, count: int) -> dict:
        """Record the next ``count`` frames (0 disarms); earlier records are discarded."""
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_TRACE:
            raise ValueError(f"trace: count must be an integer 0..{MAX_TRACE}, got {count!r}")
        self.remaining = count
        self.records = []
        self._t0 = time.monotonic_ns()
        return {"armed": count}

    def read(self) -> dict:
        """The records so far (handed over: the buffer is emptied) and how many are pending."""
        recs, self.records = self.records, []
        return {"remaining": self.remaining, "records": recs}

    def _decision(self, out_port: int, reason: int) -> str:
        if out_port >= 0:
            return self.ports[out_port] if out_port < len(self.ports) else f"port {out_port}"
        if out_port == PORT_DROP:
            try:
                return f"drop:{DropReason(reason).name}"
            except ValueError:
                return f"drop:{reason}"
        return {PORT_FLOOD: "flood", PORT_HELD: "held"}.get(out_port, "undecided")

    def record(self, batch, now_ns: int) -> None:
        """Append the first frames of ``batch`` (after the stages ran) until the count is met."""
        take = min(batch.n, self.remaining)
        for i in range(take):
            length = int(batch.length[i])
            in_port = int(batch.in_port[i])
            self.records.append({
                "t_ms": round((now_ns - self._t0) / 1e6, 3),
                "in": self.ports[in_port] if 0 <= in_port < len(self.ports) else "generated",
                "out": self._decision(int(batch.out_port[i]), int(batch.reason[i])),
                "len": length,
                **describe_frame(batch.buf[i, :length]),
            })
        self.remaining -= take
