"""A discrete-event simulation of INA workers and one aggregating switch, without a network.

The workers are the real worker kernels (:mod:`testbed.collectives.inakernel`, or its twin);
the switch is the real ``AggregateStage`` (or its twin ``AggregateReference``); frames are real
Eth/IPv4/UDP bytes. Between them a seeded channel loses, duplicates and delays (reorders)
packets in both directions. Deterministic for a seed, and fast: the protocol's invariants can
be exercised under any impairment mix in a unit test.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from testbed.collectives import ina
from testbed.collectives import inakernel as ik
from testbed.collectives.reference import inakernel as ik_ref
from testbed.datapath.aggregate import AggregateStage
from testbed.datapath.batch import PORT_DROP, PORT_HELD, PORT_UNSET, Batch
from testbed.datapath.codec import CODECS, decode_frame, encode_frame
from testbed.datapath.reference.aggregate import AggregateReference
from testbed.kernels import fixedpoint as fp
from testbed.kernels.compressors import get_compressor
from testbed.kernels.reference.packets import udp_frame
from testbed.kernels.wire import HEADER_OFFSET, TESTBED_UDP_PORT

AGG_MAC, AGG_IP = "02:54:42:00:00:fe", "10.0.0.254"
PORT = 20001


def member(r: int) -> dict:
    """Addresses of worker ``r`` (ingress port index ``r`` of the switch)."""
    return {"worker": r, "mac": f"02:00:00:00:00:{r + 1:02x}", "ip": f"10.0.0.{r + 1}",
            "port": PORT, "ingress": r}


def _raw_mac(s: str) -> bytes:
    return bytes(int(p, 16) for p in s.split(":"))


def _raw_ip(s: str) -> bytes:
    return bytes(int(p) for p in s.split("."))


class KernelSwitch:
    """The real aggregate stage, one frame per batch."""

    def __init__(self, n: int, W: int, job_id: int, seq0: int):
        ports = [f"p{r}" for r in range(n)]
        self.stage = AggregateStage(ports=ports, agg_ip=AGG_IP, agg_mac=AGG_MAC,
                                    pool_slots=max(W, 1) + 3)
        members = [dict(member(r), ingress=f"p{r}") for r in range(n)]
        self.stage.configure(jobs={job_id: {"slots": W, "seq0": seq0, "members": members}})
        self.batch = Batch(64)

    def process(self, frame: bytes, in_port: int):
        b = self.batch
        b.reset()
        b.buf[0, :len(frame)] = np.frombuffer(frame, np.uint8)
        b.length[0] = len(frame)
        b.in_port[0] = in_port
        b.n = 1
        self.stage.process(b, 0)
        results = [(int(b.out_port[i]), b.buf[i, :b.length[i]].tobytes()) for i in range(1, b.n)]
        return int(b.out_port[0]), int(b.reason[0]), results


class ReferenceSwitch:
    """The aggregate stage's plain-Python twin."""

    def __init__(self, n: int, W: int, job_id: int, seq0: int):
        self.ref = AggregateReference(AGG_MAC, AGG_IP, {
            job_id: {"slots": W, "seq0": seq0, "members": [member(r) for r in range(n)]}})

    def process(self, frame: bytes, in_port: int):
        return self.ref.process(frame, in_port)


class Sim:
    """``n`` workers reducing random vectors of ``count`` elements through one switch.

    ``loss``, ``dup``, ``reorder``: per-packet probabilities in both directions (a reordered
    packet is held back up to ``hold_s``); ``latency_s`` one way; ``kernels``: ``ik`` or its
    twin; ``switch``: ``"kernel"`` or ``"reference"``; ``mode``: ``ik.MODE_INT32``,
    ``ik.MODE_THC`` (granularity ``g``) or ``ik.MODE_NIC`` (each worker's packets cross the
    SmartNIC codec's real ``fixed32`` encode/decode kernels). ``xs``: the inputs (default
    seeded random), ``step``: THC's repetition counter.
    """

    def __init__(self, n=3, W=4, count=2000, mode=ik.MODE_INT32, seed=0, loss=0.0, dup=0.0,
                 reorder=0.0, latency_s=1e-4, hold_s=2e-3, kernels=ik, switch="kernel",
                 job_id=5, seq0=(1 << 32) - 3, reps=1, xs=None, g=16, step=0):
        if xs is not None:
            n, count = len(xs), xs[0].size
        self.n, self.W, self.count, self.mode = n, W, count, mode
        self.g, self.step = g, step
        self.rng = np.random.default_rng(seed)
        self.loss, self.dup, self.reorder = loss, dup, reorder
        self.latency_s, self.hold_s = latency_s, hold_s
        self.k = kernels
        self.job_id = job_id
        cls = KernelSwitch if switch == "kernel" else ReferenceSwitch
        self.switch = cls(n, W, job_id, seq0)
        self.xs = xs if xs is not None else [
            (self.rng.standard_normal(count) * 10.0 ** self.rng.integers(-3, 3))
            .astype(np.float32) for _ in range(n)]
        self.slots = [ik.new_slots(W, seq0) for _ in range(n)]
        self.reps = reps
        self.stats = {"switch_drops": {}, "to_switch": 0, "to_workers": 0, "results": 0}

    def _payload(self, r: int) -> ik.Payload:
        if self.mode == ik.MODE_THC:
            comp = get_compressor("thc", granularity=self.g)
            E = ina.thc_elems(self.n, self.g)
            d, blk, skey, qkey = ina.thc_layout(comp, self.count, E, self.step, r)
            K = -(-d // E)
            return ik.Payload(ik.MODE_THC, self.xs[r], np.full(self.count, np.nan, np.float32),
                              np.zeros(d, np.int32), np.full(K, ik.THC_EXP_ZERO, np.int16), K,
                              self.W, E, d, self.n, self.job_id, r, float(comp.clip),
                              float(self.g // 2), blk, skey, qkey,
                              np.zeros(ik.THC_ELEMS, np.float32))
        K = -(-self.count // ik.ELEMS)
        nic = self.mode == ik.MODE_NIC
        z = np.uint64(0)
        return ik.Payload(self.mode, self.xs[r], np.full(self.count, np.nan, np.float32),
                          np.zeros(self.count, np.int32),
                          np.full(max(K, 1), fp.EXP_MIN, np.int16), K, 0 if nic else self.W,
                          ik.ELEMS, self.count, self.n, self.job_id, r, 0.0, 1.0, 1, z, z,
                          np.zeros(ik.THC_ELEMS, np.float32))

    # --- the channel ---------------------------------------------------------------------------
    def _transmit(self, now, dst, data, port):
        if self.rng.random() < self.loss:
            return
        copies = 2 if self.rng.random() < self.dup else 1
        for _ in range(copies):
            t = now + self.latency_s
            if self.rng.random() < self.reorder:
                t += self.rng.random() * self.hold_s
            heapq.heappush(self.events, (t, next(self.tick), dst, port, data))

    def _send_rows(self, r, k, now, send_list):
        m = member(r)
        for s in send_list[:k]:
            row = self.slots[r].pkts[s, :self.slots[r].lens[s]].tobytes()
            frame = udp_frame(_raw_mac(m["mac"]), _raw_mac(AGG_MAC), _raw_ip(m["ip"]),
                              _raw_ip(AGG_IP), PORT, TESTBED_UDP_PORT, row)
            if self.mode == ik.MODE_NIC:  # the worker's SmartNIC quantises on the way out
                frame = self._nic(frame, encode=True)
            self.stats["to_switch"] += 1
            self._transmit(now, "switch", frame, r)

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
            if dst == "switch":
                decision, reason, results = self.switch.process(data, port)
                if decision == PORT_DROP:
                    self.stats["switch_drops"][reason] = \
                        self.stats["switch_drops"].get(reason, 0) + 1
                assert decision in (PORT_DROP, PORT_HELD, PORT_UNSET), decision
                for out_port, frame in results:
                    self.stats["results"] += 1
                    self._transmit(now, out_port, frame, out_port)
                continue
            r = dst
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
                ik_ref.dequantize_int32(p)
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
