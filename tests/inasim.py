"""A discrete-event simulation of INA workers and aggregating switches, without a network.

The workers are the real worker kernels (:mod:`testbed.collectives.inakernel`, or its twin);
the switches are the real ``AggregateStage`` (or its twin ``AggregateReference``); frames are
real Eth/IPv4/UDP bytes. Between any two nodes a seeded channel loses, duplicates and delays
(reorders) packets. Layouts: one switch; a two-level aggregation tree (leaf switches of
``fanout`` workers under a root); one switch whose job runs in shared mode on a pool too
small for it, with a host fallback aggregator (another aggregate stage, as on a host); or the
tree with every switch in shared mode, each with a host fallback of its own.
Deterministic for a seed, and fast: the protocol's invariants can be exercised under any
impairment mix in a unit test.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from testbed.collectives import ina
from testbed.collectives import inakernel as ik
from testbed.datapath.aggregate import AggregateStage
from testbed.datapath.batch import PORT_DROP, PORT_HELD, PORT_UNSET, Batch
from testbed.datapath.codec import CODECS, decode_frame, encode_frame
from testbed.datapath.reference.aggregate import AggregateReference
from testbed.kernels import fixedpoint as fp
from testbed.kernels.compressors import get_compressor
from testbed.kernels.reference.packets import udp_frame
from testbed.kernels.wire import FIELD_OFFSETS, HEADER_OFFSET, TESTBED_UDP_PORT, MsgType

PORT = 20001
FB_PORT = TESTBED_UDP_PORT  # a host aggregator binds the testbed port on its host


def identity(k: int) -> tuple[str, str]:
    """(MAC, IP) of switch ``k`` (0: the root, or the only switch)."""
    return f"02:54:42:01:00:{k:02x}", f"10.254.0.{k + 1}"


def worker_addr(r: int) -> tuple[str, str]:
    return f"02:00:00:00:{r >> 8:02x}:{(r & 0xFF) + 1:02x}", f"10.0.{r >> 8}.{(r & 0xFF) + 1}"


FB_MAC, FB_IP = "02:54:42:0f:00:01", "10.253.0.1"


def fb_identity(k: int) -> tuple[str, str, int]:
    """(MAC, IP, UDP port) of the host fallback of tree switch ``k`` (0: the root): each binds
    a port of its own, as the runner gives every tree level one."""
    return f"02:54:42:0f:01:{k:02x}", f"10.253.1.{k + 1}", TESTBED_UDP_PORT + k


def _raw_mac(s: str) -> bytes:
    return bytes(int(p, 16) for p in s.split(":"))


def _raw_ip(s: str) -> bytes:
    return bytes(int(p) for p in s.split("."))


def _as_list(x) -> list:
    return x if isinstance(x, list) else [x]


class Switch:
    """One aggregating node (kernel stage or twin) with ``n_ports`` ports."""

    def __init__(self, kind: str, k: int, n_ports: int, job_id: int, job: dict,
                 pool_entries: int = 0, pool_lanes: int = 256, identity_=None):
        mac, ip = identity_ or identity(k)
        self.kind = kind
        if kind == "kernel":
            self.ports = [f"p{i}" for i in range(n_ports)]
            named = dict(job, members=[dict(m, ingress=self.ports[m["ingress"]])
                                       for m in job["members"]])
            if job.get("parent"):
                named["parent"] = dict(job["parent"], egress=self.ports[job["parent"]["egress"]])
            if job.get("fallback"):
                named["fallback"] = [dict(fb, egress=self.ports[fb["egress"]])
                                     for fb in _as_list(job["fallback"])]
            self.stage = AggregateStage(ports=self.ports, agg_ip=ip, agg_mac=mac,
                                        pool_slots=job["slots"] + 3,
                                        pool_bytes=pool_entries * 4 * pool_lanes,
                                        pool_lanes=pool_lanes)
            self.stage.configure(jobs={job_id: named})
            self.batch = Batch(64)
        else:
            self.ref = AggregateReference(mac, ip, {job_id: job}, pool_entries=pool_entries,
                                          pool_lanes=pool_lanes)

    def process(self, frame: bytes, in_port: int):
        """(decision, reason, [(out port, frame)], the frame as it leaves when forwarded)."""
        if self.kind != "kernel":
            self.ref.last_frame = frame
            d, r, out = self.ref.process(frame, in_port)
            return d, int(r), out, self.ref.last_frame
        b = self.batch
        b.reset()
        b.buf[0, :len(frame)] = np.frombuffer(frame, np.uint8)
        b.length[0] = len(frame)
        b.in_port[0] = in_port
        b.n = 1
        self.stage.process(b, 0)
        out = [(int(b.out_port[i]), b.buf[i, :b.length[i]].tobytes()) for i in range(1, b.n)]
        return int(b.out_port[0]), int(b.reason[0]), out, b.buf[0, :b.length[0]].tobytes()


class Sim:
    """``n`` workers reducing random vectors of ``count`` elements through switches.

    ``loss``, ``dup``, ``reorder``: per-packet probabilities on every hop (a reordered packet
    is held back up to ``hold_s``); ``latency_s`` per hop; ``kernels``: ``ik`` or its twin;
    ``switch``: ``"kernel"`` or ``"reference"``; ``mode``: ``ik.MODE_INT32``, ``ik.MODE_THC``
    (granularity ``g``) or ``ik.MODE_NIC`` (each worker's packets cross the SmartNIC codec's
    real ``fixed32`` kernels). ``fanout``: leaf switches of that many workers under a root
    (None: one switch). ``pool``: the one switch's job runs in shared mode on a pool of that
    many entries, with a host fallback aggregator (with ``fanout``: every switch of the tree,
    each with its own); ``pool_taken``: entries another job holds (at the root).
    ``xs``: the inputs (default seeded random); ``step``: THC's repetition counter.
    """

    def __init__(self, n=3, W=4, count=2000, mode=ik.MODE_INT32, seed=0, loss=0.0, dup=0.0,
                 reorder=0.0, latency_s=1e-4, hold_s=2e-3, kernels=ik, switch="kernel",
                 job_id=5, seq0=(1 << 32) - 3, reps=1, xs=None, g=16, step=0, fanout=None,
                 pool=None, pool_taken=()):
        if xs is not None:
            n, count = len(xs), xs[0].size
        self.n, self.W, self.count, self.mode = n, W, count, mode
        self.g, self.step = g, step
        self.rng = np.random.default_rng(seed)
        self.loss, self.dup, self.reorder = loss, dup, reorder
        self.latency_s, self.hold_s = latency_s, hold_s
        self.k = kernels
        self.job_id = job_id
        self.E = ina.thc_elems(n, g) if mode == ik.MODE_THC else ik.ELEMS
        self.xs = xs if xs is not None else [
            (self.rng.standard_normal(count) * 10.0 ** self.rng.integers(-3, 3))
            .astype(np.float32) for _ in range(n)]
        self.slots = [ik.new_slots(W, seq0) for _ in range(n)]
        self.reps = reps
        self.stats = {"switch_drops": {}, "to_switch": 0, "to_workers": 0, "results": 0,
                      "fallback": 0}
        self._build(switch, seq0, fanout, pool, pool_taken)

    def _build(self, kind, seq0, fanout, pool, pool_taken):
        """Nodes, links and registrations. ``self.up[r]`` = (node, port) a worker sends to;
        ``self.links[(node, port)]`` = (peer node, peer port)."""
        n, W = self.n, self.W
        base = {"slots": W, "seq0": seq0, "lanes": self.E}
        self.nodes, self.links, self.up, self.member_id = {}, {}, {}, {}
        self.agg_of = {}
        # host fallback node -> (its switch, the switch's identity, member id -> (mac, ip,
        # port), whether its RESULTs go through the switch, its (mac, ip, port))
        self.fb_of: dict[str, tuple] = {}
        self.rank_of_ip = {_raw_ip(worker_addr(r)[1]): r for r in range(n)}

        def wmember(r, mid, port):
            mac, ip = worker_addr(r)
            return {"worker": mid, "mac": mac, "ip": ip, "port": PORT, "ingress": port}

        if fanout is None:
            job = dict(base, members=[wmember(r, r, r) for r in range(n)])
            pool_entries = 0
            if pool is not None:
                job.update(mode="shared", fallback={"mac": FB_MAC, "ip": FB_IP,
                                                    "port": FB_PORT, "egress": n})
                pool_entries = pool
                fb_job = dict(base, members=[wmember(r, r, 0) for r in range(n)],
                              mode="fallback")
                self.nodes["fb"] = Switch(kind, -1, 1, self.job_id, fb_job,
                                          identity_=(FB_MAC, FB_IP))
                self.links[("root", n)] = ("fb", 0)
                self.links[("fb", 0)] = ("root", n)
                self.fb_of["fb"] = ("root", identity(0), {r: (*worker_addr(r), PORT)
                                                          for r in range(n)}, False,
                                    (FB_MAC, FB_IP, FB_PORT))
            self.nodes["root"] = Switch(kind, 0, n + 1, self.job_id, job, pool_entries)
            if pool_taken:  # another job holds these pool entries
                self._take_pool(pool_taken)
            for r in range(n):
                self.up[r] = ("root", r)
                self.links[("root", r)] = ("w", r)
                self.member_id[r] = r
                self.agg_of[r] = identity(0)
            return
        leaves = [list(range(i, min(i + fanout, n))) for i in range(0, n, fanout)]
        root_members = []
        rmac, rip = identity(0)
        for li, ranks in enumerate(leaves):
            name = f"leaf{li}"
            lmac, lip = identity(li + 1)
            job = dict(base, members=[wmember(r, m, m) for m, r in enumerate(ranks)])
            job["parent"] = {"mac": rmac, "ip": rip, "egress": len(ranks), "index": li}
            if pool is not None:
                self._fallback(kind, name, li + 1, job, len(ranks) + 1, {
                    m: (*worker_addr(r), PORT) for m, r in enumerate(ranks)}, False, li)
            self.nodes[name] = Switch(kind, li + 1, len(ranks) + 2, self.job_id, job,
                                      pool or 0)
            for m, r in enumerate(ranks):
                self.up[r] = (name, m)
                self.links[(name, m)] = ("w", r)
                self.member_id[r] = m
                self.agg_of[r] = (lmac, lip)
            self.links[(name, len(ranks))] = ("root", li)
            self.links[("root", li)] = (name, len(ranks))
            root_members.append({"worker": li, "mac": lmac, "ip": lip,
                                 "port": TESTBED_UDP_PORT, "ingress": li})
        job = dict(base, members=root_members)
        if pool is not None:
            self._fallback(kind, "root", 0, job, len(leaves), {
                li: (*identity(li + 1), TESTBED_UDP_PORT) for li in range(len(leaves))}, True,
                None)
        self.nodes["root"] = Switch(kind, 0, len(leaves) + 1, self.job_id, job, pool or 0)
        if pool_taken:
            self._take_pool(pool_taken)

    def _fallback(self, kind, switch, k, job, port, members, via_switch, index):
        """Put ``switch``'s job (``job``, changed here) in shared mode with a host fallback on
        its port ``port``; ``members``: the switch's, by member id; ``index``: the switch's
        member id at its parent (None at the root)."""
        mac, ip, fport = fb_identity(k)
        job.update(mode="shared", fallback={"mac": mac, "ip": ip, "port": fport,
                                            "egress": port})
        fb_job = {key: v for key, v in job.items() if key in ("slots", "seq0", "lanes")}
        fb_job.update(mode="fallback", members=[
            {"worker": m, "mac": a[0], "ip": a[1], "port": a[2], "ingress": 0}
            for m, a in members.items()])
        if index is not None:  # the switch is the fallback's parent: it relays
            smac, sip = identity(k)
            fb_job["parent"] = {"mac": smac, "ip": sip, "egress": 0, "index": index}
        name = f"fb-{switch}"
        self.nodes[name] = Switch(kind, -1, 1, self.job_id, fb_job, identity_=(mac, ip))
        self.links[(switch, port)] = (name, 0)
        self.links[(name, 0)] = (switch, port)
        self.fb_of[name] = (switch, identity(k), members, via_switch, (mac, ip, fport))

    def _take_pool(self, entries):
        """Mark pool entries as held by another job's rounds (they stay so)."""
        root = self.nodes["root"]
        if root.kind == "kernel":
            owner = root.stage.regs.pool_owner
            owner[list(entries)] = root.stage.table.max_slots - 1  # a slot no job of ours has
        else:
            for e in entries:
                root.ref.pool[e] = (-1, e)

    def _payload(self, r: int) -> ik.Payload:
        mid = self.member_id[r]
        if self.mode == ik.MODE_THC:
            comp = get_compressor("thc", granularity=self.g)
            d, blk, skey, qkey = ina.thc_layout(comp, self.count, self.E, self.step, r)
            K = -(-d // self.E)
            return ik.Payload(ik.MODE_THC, self.xs[r], np.full(self.count, np.nan, np.float32),
                              np.zeros(d, np.int32), np.full(K, ik.THC_EXP_ZERO, np.int16), K,
                              self.W, self.E, d, self.n, self.job_id, mid, float(comp.clip),
                              float(self.g // 2), blk, skey, qkey,
                              np.zeros(ik.THC_ELEMS, np.float32))
        K = -(-self.count // ik.ELEMS)
        nic = self.mode == ik.MODE_NIC
        z = np.uint64(0)
        return ik.Payload(self.mode, self.xs[r], np.full(self.count, np.nan, np.float32),
                          np.zeros(self.count, np.int32),
                          np.full(max(K, 1), fp.EXP_MIN, np.int16), K, 0 if nic else self.W,
                          ik.ELEMS, self.count, self.n, self.job_id, mid, 0.0, 1.0, 1, z, z,
                          np.zeros(ik.THC_ELEMS, np.float32))

    # --- the channel ---------------------------------------------------------------------------
    def _transmit(self, now, dst, port, data):
        if self.rng.random() < self.loss:
            return
        copies = 2 if self.rng.random() < self.dup else 1
        for _ in range(copies):
            t = now + self.latency_s
            if self.rng.random() < self.reorder:
                t += self.rng.random() * self.hold_s
            heapq.heappush(self.events, (t, next(self.tick), dst, port, data))

    def _send_rows(self, r, k, now, send_list):
        mac, ip = worker_addr(r)
        amac, aip = self.agg_of[r]
        node, port = self.up[r]
        for s in send_list[:k]:
            row = self.slots[r].pkts[s, :self.slots[r].lens[s]].tobytes()
            frame = udp_frame(_raw_mac(mac), _raw_mac(amac), _raw_ip(ip), _raw_ip(aip), PORT,
                              TESTBED_UDP_PORT, row)
            if self.mode == ik.MODE_NIC:  # the worker's SmartNIC quantises on the way out
                frame = self._nic(frame, encode=True)
            self.stats["to_switch"] += 1
            self._transmit(now, node, port, frame)

    def _switch(self, now, name, port, data):
        decision, reason, emitted, fwd = self.nodes[name].process(data, port)
        if decision == PORT_DROP:
            self.stats["switch_drops"][reason] = self.stats["switch_drops"].get(reason, 0) + 1
        elif decision >= 0:  # forwarded to a host fallback, or relayed from one
            peer = self.links[(name, decision)][0]
            if peer in self.fb_of:
                self.stats["fallback"] += 1
                fwd = self._as_host_sees(peer, fwd)
            else:
                self.stats["relayed"] = self.stats.get("relayed", 0) + 1
            emitted = [(decision, fwd)] + emitted
        else:
            assert decision in (PORT_HELD, PORT_UNSET), decision
        for out_port, frame in emitted:
            self.stats["results"] += 1
            if name in self.fb_of:
                frame = self._as_host_sends(name, frame)
                if frame[30:34] in self.rank_of_ip:  # to a worker, across the fabric
                    self._transmit(now, "w", self.rank_of_ip[frame[30:34]], frame)
                    continue
            peer, peer_port = self.links[(name, out_port)]
            self._transmit(now, peer, peer_port, frame)

    def _as_host_sees(self, fb: str, frame: bytes) -> bytes:
        """What ``HostAggregator`` hands its kernel: a frame from its switch (checked here)
        gets the registered address of the member its header names, or, a RESULT (the
        parent's, relayed), the switch's."""
        switch, (smac, sip), members, _, _ = self.fb_of[fb]
        f = bytearray(frame)
        assert f[26:30] == _raw_ip(sip) and f[34:36] == TESTBED_UDP_PORT.to_bytes(
            2, "big"), "the switch forwards to its fallback from its own identity"
        f[36:38] = TESTBED_UDP_PORT.to_bytes(2, "big")  # its socket's port is its own
        if f[HEADER_OFFSET + FIELD_OFFSETS["msg_type"]] == MsgType.RESULT:
            return bytes(f)
        m = int.from_bytes(f[HEADER_OFFSET + FIELD_OFFSETS["worker_id"]:][:2], "little")
        mac, ip, port = members[m]
        f[6:12], f[26:30], f[34:36] = _raw_mac(mac), _raw_ip(ip), port.to_bytes(2, "big")
        return bytes(f)

    def _as_host_sends(self, fb: str, frame: bytes) -> bytes:
        """What leaves ``HostAggregator``'s socket: from its bound port; a RESULT for a member
        switch addressed to its own switch, which relays it."""
        _, (smac, sip), _, via_switch, (_, _, fport) = self.fb_of[fb]
        f = bytearray(frame)
        f[34:36] = fport.to_bytes(2, "big")
        if via_switch and f[HEADER_OFFSET + FIELD_OFFSETS["msg_type"]] == MsgType.RESULT:
            f[0:6], f[30:34] = _raw_mac(smac), _raw_ip(sip)
            f[36:38] = TESTBED_UDP_PORT.to_bytes(2, "big")
        return bytes(f)

    # --- run -------------------------------------------------------------------------------------
    def run(self, max_time_s: float = 60.0) -> list[ik.Payload]:
        """Run ``reps`` collectives; return the last one's payload of every worker."""
        for _ in range(self.reps):
            out = self._run_once(max_time_s)
        return out

    def _run_once(self, max_time_s):
        self.events: list = []
        self.tick = itertools.count()
        k = self.k
        now = 0.0
        ps = [self._payload(r) for r in range(self.n)]
        loops = [ik.new_loop(now) for _ in range(self.n)]
        total = ps[0].K + ps[0].boot
        done = [0] * self.n
        send_list = np.zeros(self.W, np.int64)
        rbuf = np.zeros((1, 2048), np.uint8)
        rlen = np.zeros(1, np.int64)
        no_drop = np.zeros(1, np.bool_)
        for r in range(self.n):
            m = k.start(self.slots[r], loops[r], ps[r], now, send_list)
            self._send_rows(r, m, now, send_list)
        while min(done) < total:
            deadlines = [(float(self.slots[r].deadline.min()), r) for r in range(self.n)
                         if done[r] < total]
            t_timer, r_timer = min(deadlines)
            if self.events and self.events[0][0] <= t_timer:
                now, _, dst, port, data = heapq.heappop(self.events)
            else:
                now = t_timer
                m = k.expire(self.slots[r_timer], loops[r_timer], now, send_list)
                self._send_rows(r_timer, m, now, send_list)
                continue
            if now > max_time_s:
                raise TimeoutError(f"simulation stuck at t={now:.3f} s: done={done}/{total}")
            if dst != "w":
                self._switch(now, dst, port, data)
                continue
            r = port
            if self.mode == ik.MODE_NIC:  # ... and widens the INT32 result on the way in
                data = self._nic(data, encode=False)
            data = data[HEADER_OFFSET:]
            rbuf[0, :len(data)] = np.frombuffer(data, np.uint8)
            rlen[0] = len(data)
            self.stats["to_workers"] += 1
            d, ns, _ign, _lost, bad, code = k.on_results(rbuf, rlen, 1, no_drop, self.slots[r],
                                                         loops[r], ps[r], now, send_list)
            assert bad < 0, (bad, code)
            done[r] += d
            self._send_rows(r, ns, now, send_list)
        for p in ps:
            if self.mode == ik.MODE_INT32:
                k.dequantize_int32(p)
        self.now = now
        return ps

    def _nic(self, frame: bytes, encode: bool) -> bytes:
        f = np.zeros(2048, np.uint8)
        f[:len(frame)] = np.frombuffer(frame, np.uint8)
        if encode:
            n, _ = encode_frame(f, CODECS["fixed32"], ina.NIC_FACTOR,
                                np.zeros(ik.ELEMS, np.float32))
        else:
            n = decode_frame(f, ina.NIC_FACTOR, np.zeros(ik.ELEMS, np.uint8))
        return f[:n].tobytes()

    def expected_qsum(self, p0: ik.Payload) -> np.ndarray:
        """The exact int32 sum every worker must hold: each input quantised with the agreed
        exponents (the max over workers per chunk), summed with int32 wrap-around."""
        exps = np.max([fp.exponents(x, ik.ELEMS) for x in self.xs], axis=0)
        assert np.array_equal(exps, p0.agreed[:exps.size])
        qs = np.stack([fp.quantize(x, exps, self.n, ik.ELEMS) for x in self.xs])
        return fp.aggregate(qs)

    def expected_nic(self) -> np.ndarray:
        """What MODE_NIC workers must hold: ATP fixed point of each input, summed, divided."""
        qs = np.stack([fp.atp_quantize(x, ina.NIC_FACTOR)[0] for x in self.xs])
        return fp.atp_dequantize(fp.atp_aggregate(qs)[0], ina.NIC_FACTOR)
