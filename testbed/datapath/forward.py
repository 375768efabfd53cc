"""The ``forward`` program: L2 table with ECMP groups and MAC learning, optional L3 /32 routes.

Tables live in numpy arrays (open-addressing hash tables keyed by MAC or IPv4 address) that one
``@njit`` call per burst walks. A table value is a *group*: groups ``0..n_ports-1`` are the
single ports, later groups are ECMP port lists; a packet picks a member of its group by a hash of
its IPv4 5-tuple, so one flow always takes one path.

Decision order for a packet no earlier stage decided:
1. frame shorter than an Ethernet header -> drop ``TOO_SHORT``; an IPv4 frame whose IP header is
   broken (version, IHL, total length) -> drop with that reason (``validate``, default on);
2. learn the source MAC on the ingress port (``learn``, default on; static entries win);
3. L3 route for the destination IPv4 address, if any;
4. L2: multicast/broadcast -> flood; known MAC -> its group; unknown -> flood (``flood``, default
   on) or drop ``NO_ROUTE``. A destination on the ingress port is filtered (drop ``OTHER``).

:class:`WireStage` (``wire``) is the bump-in-the-wire program of a two-port SmartNIC.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from testbed.datapath.batch import (
    PORT_DROP,
    PORT_FLOOD,
    PORT_UNSET,
    Batch,
    DropReason,
    PackedStage,
    Stage,
)
from testbed.kernels.packed import arrays_at

TABLE_SIZE = 4096  # power of two
MAX_GROUP_PORTS = 16
MAX_GROUPS = 256
_USED = np.uint64(1) << np.uint64(56)  # key marker so that address 0 is storable

# counter slots
C_UNICAST, C_FLOODED, C_LEARNED, C_L3_HITS, C_LEARN_FULL, C_FILTERED, C_DROPPED = range(7)
COUNTER_NAMES = ("unicast", "flooded", "learned", "l3_hits", "learn_table_full", "filtered",
                 "dropped")

_R_TOO_SHORT = int(DropReason.TOO_SHORT)
_R_BAD_LENGTH = int(DropReason.BAD_LENGTH)
_R_NO_ROUTE = int(DropReason.NO_ROUTE)
_R_OTHER = int(DropReason.OTHER)
_R_NOT_IPV4 = int(DropReason.NOT_IPV4)


def mac_to_int(mac: str | bytes) -> int:
    """``'02:00:00:00:00:01'`` or 6 raw bytes -> integer (network byte order)."""
    if isinstance(mac, str):
        parts = mac.split(":")
        if len(parts) != 6:
            raise ValueError(f"bad MAC address {mac!r}: expected 6 ':'-separated hex bytes")
        try:
            raw = bytes(int(p, 16) for p in parts)
        except ValueError:
            raise ValueError(f"bad MAC address {mac!r}: expected hex bytes") from None
    else:
        raw = bytes(mac)
        if len(raw) != 6:
            raise ValueError(f"bad MAC address {mac!r}: expected 6 bytes")
    return int.from_bytes(raw, "big")


def ip_to_int(ip: str) -> int:
    """Dotted IPv4 -> integer (network byte order)."""
    parts = ip.split(".")
    if len(parts) != 4 or not all(p.isdigit() and int(p) < 256 for p in parts):
        raise ValueError(f"bad IPv4 address {ip!r}: expected dotted quad like 10.0.0.1")
    return int.from_bytes(bytes(int(p) for p in parts), "big")


@njit(cache=True)
def _slot_of(key):
    h = key * np.uint64(0x9E3779B97F4A7C15)
    return np.int64(h >> np.uint64(52)) & (TABLE_SIZE - 1)


@njit(cache=True)
def table_lookup(keys, vals, key):
    """Value stored for ``key`` in an open-addressing table, or -1."""
    k = key | _USED
    i = _slot_of(k)
    for _ in range(TABLE_SIZE):
        if keys[i] == k:
            return vals[i]
        if keys[i] == 0:
            return -1
        i = (i + 1) & (TABLE_SIZE - 1)
    return -1


@njit(cache=True)
def table_insert(keys, vals, static, key, val, is_static):
    """Insert/update ``key``; a learned update never overwrites a static entry.

    Returns 1 if stored, 0 if refused (static wins), -1 if the table is full.
    """
    k = key | _USED
    i = _slot_of(k)
    for _ in range(TABLE_SIZE):
        if keys[i] == k:
            if static[i] and not is_static:
                return 0
            vals[i] = val
            static[i] = is_static
            return 1
        if keys[i] == 0:
            keys[i] = k
            vals[i] = val
            static[i] = is_static
            return 1
        i = (i + 1) & (TABLE_SIZE - 1)
    return -1


@njit(cache=True)
def flow_hash(frame, length):
    """Hash of the IPv4 5-tuple (src, dst, proto, sport, dport); 0 for non-IPv4 frames."""
    if length < 34 or frame[12] != 0x08 or frame[13] != 0x00:
        return np.uint64(0)
    h = np.uint64(0xCBF29CE484222325)
    ihl = (frame[14] & 0x0F) * 4
    for j in range(26, 34):  # src + dst IP
        h = (h ^ np.uint64(frame[j])) * np.uint64(0x100000001B3)
    proto = frame[23]
    h = (h ^ np.uint64(proto)) * np.uint64(0x100000001B3)
    p = 14 + ihl
    if (proto == 6 or proto == 17) and length >= p + 4:
        for j in range(p, p + 4):  # sport + dport
            h = (h ^ np.uint64(frame[j])) * np.uint64(0x100000001B3)
    return h ^ (h >> np.uint64(29))


@njit(cache=True)
def forward_kernel(buf, length, in_port, out_port, reason, n, mac_keys, mac_vals, mac_static,
                   ip_keys, ip_vals, n_ip, group_ports, group_len, n_ports, learn, flood,
                   validate, counters):
    """Decide ``out_port`` for every undecided packet of the batch (see module docstring)."""
    for i in range(n):
        if out_port[i] != PORT_UNSET:
            continue
        ln = length[i]
        f = buf[i]
        if ln < 14:
            out_port[i] = PORT_DROP
            reason[i] = _R_TOO_SHORT
            counters[C_DROPPED] += 1
            continue
        is_ip = f[12] == 0x08 and f[13] == 0x00
        if is_ip and validate:
            if ln < 34:
                out_port[i] = PORT_DROP
                reason[i] = _R_TOO_SHORT
                counters[C_DROPPED] += 1
                continue
            ihl = f[14] & 0x0F
            tot = (np.int64(f[16]) << 8) | f[17]
            if (f[14] >> 4) != 4:
                out_port[i] = PORT_DROP
                reason[i] = _R_NOT_IPV4
                counters[C_DROPPED] += 1
                continue
            if ihl < 5 or tot < ihl * 4 or tot > ln - 14:
                out_port[i] = PORT_DROP
                reason[i] = _R_BAD_LENGTH
                counters[C_DROPPED] += 1
                continue
        src = np.uint64(0)
        dst = np.uint64(0)
        for j in range(6):
            dst = (dst << np.uint64(8)) | np.uint64(f[j])
            src = (src << np.uint64(8)) | np.uint64(f[6 + j])
        ip_ = in_port[i]
        if learn and ip_ >= 0 and (f[6] & 1) == 0:
            cur = table_lookup(mac_keys, mac_vals, src)
            if cur != ip_:
                r = table_insert(mac_keys, mac_vals, mac_static, src, np.int32(ip_), False)
                if r == 1:
                    counters[C_LEARNED] += 1
                elif r < 0:
                    counters[C_LEARN_FULL] += 1
        g = -1
        if n_ip > 0 and is_ip and ln >= 34:
            dip = np.uint64(0)
            for j in range(30, 34):
                dip = (dip << np.uint64(8)) | np.uint64(f[j])
            g = table_lookup(ip_keys, ip_vals, dip)
            if g >= 0:
                counters[C_L3_HITS] += 1
        if g < 0:
            if f[0] & 1:  # multicast / broadcast
                out_port[i] = PORT_FLOOD
                counters[C_FLOODED] += 1
                continue
            g = table_lookup(mac_keys, mac_vals, dst)
        if g < 0:
            if flood:
                out_port[i] = PORT_FLOOD
                counters[C_FLOODED] += 1
            else:
                out_port[i] = PORT_DROP
                reason[i] = _R_NO_ROUTE
                counters[C_DROPPED] += 1
            continue
        m = group_len[g]
        if m == 1:
            p = group_ports[g, 0]
        else:
            p = group_ports[g, np.int64(flow_hash(f, ln) % np.uint64(m))]
        if p == ip_:
            out_port[i] = PORT_DROP
            reason[i] = _R_OTHER
            counters[C_FILTERED] += 1
            continue
        out_port[i] = p
        counters[C_UNICAST] += 1


#: the arrays :func:`forward_packed` takes in its table: the batch's five, then the stage's
FORWARD_SPEC = "u1:2 i4:1 i2:1 i2:1 u1:1 u8:1 i4:1 b1:1 u8:1 i4:1 i2:2 i2:1 i8:1"


@njit(cache=True)
def forward_packed(table, n, n_ip, n_ports, learn, flood, validate):
    """:func:`forward_kernel` with its arrays in one table (:mod:`testbed.kernels.packed`)."""
    (buf, length, in_port, out_port, reason, mac_keys, mac_vals, mac_static, ip_keys, ip_vals,
     group_ports, group_len, counters) = arrays_at(table, FORWARD_SPEC)
    return forward_kernel(buf, length, in_port, out_port, reason, n, mac_keys, mac_vals,
                          mac_static, ip_keys, ip_vals, n_ip, group_ports, group_len, n_ports,
                          learn, flood, validate, counters)


class ForwardStage(PackedStage):
    """L2/L3 forwarding with ECMP and MAC learning (program name ``forward``).

    Settings: ``l2`` {mac: port or [ports]}, ``l3`` {ipv4: port or [ports]} (ports by index or
    name), ``learn`` (bool), ``flood`` (unknown unicast floods, else drops ``NO_ROUTE``),
    ``validate`` (drop broken IPv4 headers). Flooding goes to the engine's ``flood_ports``.
    """

    name = "forward"
    batch_arrays = ("buf", "length", "in_port", "out_port", "reason")
    stage_arrays = ("mac_keys", "mac_vals", "mac_static", "ip_keys", "ip_vals", "group_ports",
                    "group_len", "counters_arr")
    spec = FORWARD_SPEC

    def __init__(self, ports: list[str] | None = None, l2: dict | None = None,
                 l3: dict | None = None, learn: bool = True, flood: bool = True,
                 validate: bool = True):
        self.ports = list(ports) if ports else []
        self.n_ports = len(self.ports)
        if self.n_ports == 0:
            raise ValueError("forward: the node has no ports (pass ports=[...])")
        if self.n_ports > MAX_GROUPS // 2:
            raise ValueError(f"forward: at most {MAX_GROUPS // 2} ports, got {self.n_ports}")
        self.mac_keys = np.zeros(TABLE_SIZE, np.uint64)
        self.mac_vals = np.full(TABLE_SIZE, -1, np.int32)
        self.mac_static = np.zeros(TABLE_SIZE, np.bool_)
        self.ip_keys = np.zeros(TABLE_SIZE, np.uint64)
        self.ip_vals = np.full(TABLE_SIZE, -1, np.int32)
        self.ip_static = np.zeros(TABLE_SIZE, np.bool_)
        self.n_ip = 0
        self.group_ports = np.zeros((MAX_GROUPS, MAX_GROUP_PORTS), np.int16)
        self.group_len = np.zeros(MAX_GROUPS, np.int16)
        for p in range(self.n_ports):  # groups 0..n-1 are the single ports
            self.group_ports[p, 0] = p
            self.group_len[p] = 1
        self.n_groups = self.n_ports
        self._group_ids: dict[tuple[int, ...], int] = {}
        self.counters_arr = np.zeros(len(COUNTER_NAMES), np.int64)
        self.learn = bool(learn)
        self.flood = bool(flood)
        self.validate = bool(validate)
        self.configure(l2=l2 or {}, l3=l3 or {})

    def _port_index(self, p) -> int:
        if isinstance(p, str):
            if p not in self.ports:
                raise ValueError(f"forward: unknown port {p!r}; ports are {self.ports}")
            return self.ports.index(p)
        p = int(p)
        if not 0 <= p < self.n_ports:
            raise ValueError(f"forward: port index {p} outside 0..{self.n_ports - 1}")
        return p

    def _group(self, target) -> int:
        if isinstance(target, (list, tuple)):
            members = tuple(self._port_index(p) for p in target)
            if not members or len(members) > MAX_GROUP_PORTS:
                raise ValueError(f"forward: an ECMP group needs 1..{MAX_GROUP_PORTS} ports")
            if len(members) == 1:
                return members[0]
            if members not in self._group_ids:
                if self.n_groups >= MAX_GROUPS:
                    raise ValueError(f"forward: more than {MAX_GROUPS} ECMP groups")
                g = self.n_groups
                self.group_ports[g, : len(members)] = members
                self.group_len[g] = len(members)
                self._group_ids[members] = g
                self.n_groups += 1
            return self._group_ids[members]
        return self._port_index(target)

    def configure(self, l2: dict | None = None, l3: dict | None = None, learn=None, flood=None,
                  validate=None, **unknown) -> None:
        """Add static L2/L3 entries (``{address: port | [ports]}``) or change the switches."""
        if unknown:
            raise ValueError(f"forward: unknown settings {sorted(unknown)}; "
                             "use l2, l3, learn, flood, validate")
        for mac, target in (l2 or {}).items():
            r = table_insert(self.mac_keys, self.mac_vals, self.mac_static,
                             np.uint64(mac_to_int(mac)), np.int32(self._group(target)), True)
            if r < 0:
                raise ValueError(f"forward: L2 table full ({TABLE_SIZE} entries)")
        for ip, target in (l3 or {}).items():
            r = table_insert(self.ip_keys, self.ip_vals, self.ip_static,
                             np.uint64(ip_to_int(ip)), np.int32(self._group(target)), True)
            if r < 0:
                raise ValueError(f"forward: L3 table full ({TABLE_SIZE} entries)")
            self.n_ip += 1
        if learn is not None:
            self.learn = bool(learn)
        if flood is not None:
            self.flood = bool(flood)
        if validate is not None:
            self.validate = bool(validate)

    def process(self, batch: Batch, now_ns: int) -> None:
        """Forward the undecided packets of ``batch`` (one Numba call)."""
        forward_packed(self.table(batch), batch.n, self.n_ip, self.n_ports, self.learn,
                       self.flood, self.validate)

    def counters(self) -> dict:
        """Forwarding decisions and learning events so far."""
        out = {k: int(v) for k, v in zip(COUNTER_NAMES, self.counters_arr, strict=False)}
        out["l2_entries"] = int(np.count_nonzero(self.mac_keys))
        return out


@njit(cache=True)
def wire_kernel(in_port, out_port, n):
    """Cross-connect ports 0 and 1: everything from one leaves by the other."""
    for i in range(n):
        if out_port[i] == PORT_UNSET and in_port[i] >= 0:
            out_port[i] = 1 - in_port[i]


def wire_reference(in_port: np.ndarray, out_port: np.ndarray) -> np.ndarray:
    """Numpy twin of :func:`wire_kernel` (returns the new out_port array)."""
    out = out_port.copy()
    sel = (out_port == PORT_UNSET) & (in_port >= 0)
    out[sel] = 1 - in_port[sel]
    return out


class WireStage(Stage):
    """Bump in the wire between port 0 and port 1 (program name ``wire``; SmartNIC default)."""

    name = "wire"

    def __init__(self, ports: list[str] | None = None):
        if ports is not None and len(ports) != 2:
            raise ValueError(f"wire: needs exactly 2 ports, got {list(ports)}")
        self.passed = 0

    def process(self, batch: Batch, now_ns: int) -> None:
        """Send each undecided packet out of the other port."""
        wire_kernel(batch.in_port, batch.out_port, batch.n)
        self.passed += batch.n

    def counters(self) -> dict:
        """Packets seen."""
        return {"seen": self.passed}


# ---------------------------------------------------------------------------------------------
# Plain-Python reference twin of forward_kernel (tests compare the two on random batches).


def forward_reference(frames: list[bytes], in_ports: list[int], l2: dict[int, list[int]],
                      l3: dict[int, list[int]], learned: dict[int, int], learn: bool,
                      flood: bool, validate: bool) -> list[tuple[int, int]]:
    """Per-packet dict-based model of :func:`forward_kernel`; returns (out_port, reason).

    ``l2``/``l3`` map address -> member ports (static); ``learned`` is updated in place.
    ECMP member choice uses the same :func:`flow_hash` definition, recomputed in Python.
    """
    out = []
    for f, ip_ in zip(frames, in_ports, strict=False):
        ln = len(f)
        if ln < 14:
            out.append((PORT_DROP, _R_TOO_SHORT))
            continue
        is_ip = f[12:14] == b"\x08\x00"
        if is_ip and validate:
            if ln < 34:
                out.append((PORT_DROP, _R_TOO_SHORT))
                continue
            ihl, tot = f[14] & 15, int.from_bytes(f[16:18], "big")
            if f[14] >> 4 != 4:
                out.append((PORT_DROP, _R_NOT_IPV4))
                continue
            if ihl < 5 or tot < ihl * 4 or tot > ln - 14:
                out.append((PORT_DROP, _R_BAD_LENGTH))
                continue
        dst, src = int.from_bytes(f[0:6], "big"), int.from_bytes(f[6:12], "big")
        if learn and ip_ >= 0 and not f[6] & 1 and src not in l2:
            learned[src] = ip_
        members = None
        if l3 and is_ip and ln >= 34:
            members = l3.get(int.from_bytes(f[30:34], "big"))
        if members is None:
            if f[0] & 1:
                out.append((PORT_FLOOD, 0))
                continue
            members = l2.get(dst)
            if members is None and dst in learned:
                members = [learned[dst]]
        if members is None:
            out.append((PORT_FLOOD, 0) if flood else (PORT_DROP, _R_NO_ROUTE))
            continue
        if len(members) == 1:
            p = members[0]
        else:
            p = members[flow_hash_reference(f) % len(members)]
        out.append((PORT_DROP, _R_OTHER) if p == ip_ else (p, 0))
    return out


def flow_hash_reference(f: bytes) -> int:
    """Pure-Python twin of :func:`flow_hash` (64-bit FNV-1a over the 5-tuple, then a fold)."""
    m = (1 << 64) - 1
    if len(f) < 34 or f[12:14] != b"\x08\x00":
        return 0
    h = 0xCBF29CE484222325
    data = list(f[26:34]) + [f[23]]
    p = 14 + (f[14] & 15) * 4
    if f[23] in (6, 17) and len(f) >= p + 4:
        data += list(f[p : p + 4])
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & m
    return h ^ (h >> 29)
