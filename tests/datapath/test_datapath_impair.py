"""The ``impair`` stage on batches of real frames: seeded loss statistics and determinism,
duplication, reordering, delay/jitter, ingress mode, filter, overflow, and the plain-Python twin."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.datapath.batch import PORT_DROP, PORT_HELD, PORT_UNSET, Batch, DropReason
from testbed.datapath.impair import ImpairStage, port_seed
from testbed.kernels import packets, wire
from testbed.kernels.reference import packets as ref_packets
from testbed.kernels.reference.trimming import uniform01 as ref_uniform01

T0 = 7_000_000_000
MS = 1_000_000


def frames(count: int, m: int = 4, start: int = 0):
    """Small testbed frames numbered by ``chunk_offset`` (start, start+1, ...)."""
    h = wire.new_headers(count)
    h["elem_count"] = m
    h["chunk_offset"] = np.arange(start, start + count)
    buf, ln = packets.build(h, [np.zeros(m, np.int32)] * count, "02:00:00:00:00:01",
                            "02:00:00:00:00:02", "10.0.0.1", "10.0.0.2", 5000)
    return [bytes(buf[i, :ln[i]]) for i in range(count)]


def number(f: bytes) -> int:
    """The ``chunk_offset`` a frame of :func:`frames` carries."""
    return int(wire.unpack_header(f, wire.HEADER_OFFSET)["chunk_offset"])


def load(batch: Batch, fs, port: int, egress: bool = True) -> None:
    """Fill an empty batch: egress frames forwarded to ``port``, or ingress from ``port``."""
    batch.reset()
    for f in fs:
        i = batch.alloc(1)
        batch.buf[i, :len(f)] = np.frombuffer(f, np.uint8)
        batch.length[i] = len(f)
        batch.in_port[i] = 0 if egress else port
        if egress:
            batch.out_port[i] = port


def sent(batch: Batch):
    """Frames leaving (egress) from this batch in row order."""
    return [bytes(batch.buf[i, :batch.length[i]]) for i in range(batch.n) if batch.out_port[i] >= 0]


def run(stage: ImpairStage, fs, chunk: int, port: int = 0, now: int = T0):
    """Push ``fs`` through the stage ``chunk`` frames per batch; return per-frame decisions."""
    b = Batch(3 * chunk + 16)
    out = []
    for lo in range(0, len(fs), chunk):
        load(b, fs[lo:lo + chunk], port)
        stage.process(b, now)
        out += [int(b.out_port[i]) for i in range(min(chunk, len(fs) - lo))]
    return np.array(out)


# ---------------------------------------------------------------------------------------------


def test_seeded_loss_rate_and_determinism_across_batchings():
    fs = frames(20000, m=1)
    a = run(ImpairStage(n_ports=1, loss=0.1, seed=42), fs, chunk=64)
    b = run(ImpairStage(n_ports=1, loss=0.1, seed=42), fs, chunk=7)  # other burst sizes
    c = run(ImpairStage(n_ports=1, loss=0.1, seed=43), fs, chunk=64)
    lost = int((a == PORT_DROP).sum())
    sd = (20000 * 0.1 * 0.9) ** 0.5
    assert abs(lost - 2000) < 5 * sd
    np.testing.assert_array_equal(a, b)  # same seed, same packet sequence -> same drops
    assert (a != c).any()
    # the drop pattern is the documented function of (seed, port, packet index)
    u = ref_uniform01(int(port_seed(42, 0)), np.arange(20000, dtype=np.int64) * 4)
    np.testing.assert_array_equal(a == PORT_DROP, u < 0.1)
    s = ImpairStage(n_ports=1, loss=1.0)
    bb = Batch(8)
    load(bb, fs[:3], 0)
    s.process(bb, T0)
    assert all(bb.reason[i] == DropReason.IMPAIR_LOSS for i in range(3))
    assert s.counters()["totals"]["lost"] == 3


def test_ports_have_independent_streams():
    fs = frames(2000, m=1)
    s = ImpairStage(n_ports=2, loss={0: 0.3, 1: 0.3}, seed=5)
    a = run(s, fs, 50, port=0)
    b = run(s, fs, 50, port=1)
    assert (a != b).any()
    assert s.counters()["ports"]["port0"]["seen"] == 2000


def test_delay_line_releases_on_time_and_in_order():
    fs = frames(10)
    s = ImpairStage(n_ports=2, delay_ms=5.0)
    b = Batch(64)
    load(b, fs, 1)
    s.process(b, T0)
    assert list(b.out_port[:10]) == [PORT_HELD] * 10
    assert s.next_deadline_ns() == T0 + 5 * MS
    b.reset()
    s.process(b, T0 + 5 * MS - 1)
    assert sent(b) == []
    b.reset()
    s.process(b, T0 + 5 * MS)
    assert sent(b) == fs and list(b.out_port[:b.n]) == [1] * 10
    assert s.next_deadline_ns() is None and s.held() == 0


def test_jitter_stays_in_bounds_and_never_reorders():
    fs = frames(200)
    s = ImpairStage(n_ports=1, delay_ms=2.0, jitter_ms=1.0, seed=9)
    b = Batch(512)
    got, times = [], []
    for k in range(200):  # one packet every 20 us
        load(b, fs[k:k + 1], 0)
        s.process(b, T0 + k * 20_000)
        got += sent(b)
        times += [T0 + k * 20_000] * len(sent(b))
    t = T0 + 200 * 20_000
    while s.held():
        t += 10_000
        b.reset()
        s.process(b, t)
        got += sent(b)
        times += [t] * len(sent(b))
    assert [number(f) for f in got] == list(range(200))  # FIFO despite jitter
    delays = np.array(times) - (T0 + np.arange(200) * 20_000)
    assert delays.min() >= 1 * MS - 20_000 and delays.max() <= 3 * MS + 20_000
    assert delays.std() > 0.1 * MS  # jitter did something


def test_duplicates_are_identical_copies():
    fs = frames(400)
    s = ImpairStage(n_ports=1, dup=0.25, seed=3)
    b = Batch(1024)
    load(b, fs, 0)
    s.process(b, T0)
    out = sent(b)
    ndup = s.counters()["totals"]["duplicated"]
    assert len(out) == 400 + ndup and 60 < ndup < 140
    nums = [number(f) for f in out]
    assert sorted(set(nums)) == list(range(400))
    for f in out[400:]:
        assert f == fs[number(f)]


def test_reorder_holds_back_k_positions_then_times_out():
    fs = frames(6)
    s = ImpairStage(n_ports=1, reorder=1.0, reorder_k=2, reorder_timeout_ms=3.0)
    b = Batch(16)
    load(b, fs[:1], 0)
    s.process(b, T0)
    assert b.out_port[0] == PORT_HELD
    s.configure(reorder=0.0)
    order = []
    for k in range(1, 4):  # one later packet per burst
        load(b, fs[k:k + 1], 0)
        s.process(b, T0 + k)
        order += [number(f) for f in sent(b)]
    assert order == [1, 2, 0, 3]  # packet 0 left right after the 2nd later packet
    s.configure(reorder=1.0)
    load(b, fs[4:5], 0)
    s.process(b, T0 + 10)
    assert s.next_deadline_ns() == T0 + 10 + 3 * MS  # nothing follows: its timeout wakes us
    b.reset()
    s.process(b, T0 + 10 + 3 * MS)
    assert [number(f) for f in sent(b)] == [4]
    assert s.counters()["totals"]["reordered"] == 2


def test_ingress_mode_reemits_with_in_port_and_undecided():
    fs = frames(3)
    s = ImpairStage(n_ports=3, direction="ingress", delay_ms=1.0)
    b = Batch(16)
    load(b, fs, 2, egress=False)
    b.out_port[2] = 0  # already decided by an earlier stage: not ours to touch
    s.process(b, T0)
    assert list(b.out_port[:3]) == [PORT_HELD, PORT_HELD, 0]
    b.reset()
    s.process(b, T0 + MS)
    assert b.n == 2 and list(b.in_port[:2]) == [2, 2]
    assert list(b.out_port[:2]) == [PORT_UNSET, PORT_UNSET]


def test_filter_testbed_bypasses_other_traffic_and_ring_overflow_drops():
    junk = [bytes(60)] * 3
    fs = frames(3)
    s = ImpairStage(n_ports=1, filter="testbed", delay_ms=1.0, slots=2)
    b = Batch(16)
    load(b, junk + fs, 0)
    s.process(b, T0)
    assert list(b.out_port[:6]) == [0, 0, 0, PORT_HELD, PORT_HELD, PORT_DROP]
    assert b.reason[5] == DropReason.QUEUE_FULL
    c = s.counters()["ports"]["port0"]
    assert (c["bypassed"], c["seen"], c["delayed"], c["overflow"]) == (3, 3, 2, 1)


def test_configure_validates_and_is_all_or_nothing():
    s = ImpairStage(ports=["tbh1-eth0", "tbs1-eth1"], loss={"tbs1-eth1": 0.5})
    assert list(s.loss) == [0.0, 0.5]
    with pytest.raises(ValueError, match="loss"):
        s.configure(dup=0.1, loss=1.5)
    assert list(s.dup) == [0.0, 0.0]
    with pytest.raises(ValueError, match="direction"):
        ImpairStage(n_ports=1, direction="sideways")
    with pytest.raises(ValueError, match="filter"):
        s.configure(filter="tcp")
    with pytest.raises(ValueError, match="unknown settings"):
        s.configure(latency=3)
    with pytest.raises(ValueError, match="reorder_k"):
        s.configure(reorder_k=0)
    with pytest.raises(ValueError, match="unknown port"):
        s.configure(delay_ms={"tbh9-eth0": 1})


def ref_valid(f: bytes) -> bool:
    """The numpy twin of ``parse_frame`` accepts ``f`` as a testbed frame."""
    return ref_packets.parse_frame(np.frombuffer(f, np.uint8), len(f))[0] == 0


# ---------------------------------------------------------------------------------------------
# plain-Python twin


class ImpairTwin:
    """List-based model of ``impair_kernel`` for one direction (egress)."""

    def __init__(self, n_ports, seed, loss, dup, reorder, k, delay_ns, jitter_ns, timeout_ns,
                 slots, only_testbed):
        self.seeds = [int(port_seed(seed, p)) for p in range(n_ports)]
        self.loss, self.dup, self.reorder, self.k = loss, dup, reorder, k
        self.delay, self.jitter, self.timeout, self.slots = delay_ns, jitter_ns, timeout_ns, slots
        self.only_testbed = only_testbed
        self.seq = [0] * n_ports
        self.passed = [0] * n_ports
        self.last_rel = [0] * n_ports
        self.pend = [0] * n_ports
        self.ring = [[] for _ in range(n_ports)]  # [used, frame, kind, rel, need, timeout]

    def u(self, p, idx, effect):
        return float(ref_uniform01(self.seeds[p], np.array([idx * 4 + effect]))[0])

    def hold(self, p, f, kind, rel, need, timeout):
        if len(self.ring[p]) >= self.slots:
            return False
        self.ring[p].append([True, f, kind, rel, need, timeout])
        self.pend[p] += kind == 0
        return True

    def release(self, now, out):
        for p, ring in enumerate(self.ring):
            for e in ring:
                used, f, kind, rel, need, timeout = e
                if not used:
                    continue
                due = now >= rel and (kind != 1 or self.passed[p] >= need or now >= timeout)
                if due:
                    out.append((f, p))
                    e[0] = False
                    self.passed[p] += 1
                    self.pend[p] -= kind == 0
            while ring and not ring[0][0]:
                ring.pop(0)

    def process(self, pkts, now):
        out, decisions = [], []
        self.release(now, out)
        for f, p in pkts:
            if self.only_testbed and not ref_valid(f):
                decisions.append(p)
                continue
            idx = self.seq[p]
            self.seq[p] += 1
            if self.loss > 0 and self.u(p, idx, 0) < self.loss:
                decisions.append(PORT_DROP)
                continue
            copy = self.dup > 0 and self.u(p, idx, 1) < self.dup
            delayed = self.delay > 0 or self.jitter > 0
            rel = now
            if delayed:
                rel = now + self.delay
                if self.jitter > 0:
                    rel += int((2.0 * self.u(p, idx, 3) - 1.0) * self.jitter)
                    rel = max(rel, now)
            kind = -1
            if self.reorder > 0 and self.u(p, idx, 2) < self.reorder:
                kind = 1
            elif delayed or self.pend[p] > 0:
                kind = 0
                rel = max(rel, self.last_rel[p])
                self.last_rel[p] = rel
            if kind < 0:
                self.passed[p] += 1
                decisions.append(p)
            elif self.hold(p, f, kind, rel, self.passed[p] + self.k, rel + self.timeout):
                decisions.append(PORT_HELD)
            else:
                decisions.append(PORT_DROP)
                continue
            if copy:
                ck = 0 if kind == 0 else 2
                self.hold(p, f, ck, rel if ck == 0 else now, 0, 0)
        self.release(now, out)
        return decisions, out


_POOL = frames(6) + [bytes(range(64))]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), loss=st.sampled_from([0.0, 0.2]),
       dup=st.sampled_from([0.0, 0.3]), reorder=st.sampled_from([0.0, 0.3]),
       k=st.integers(1, 3), delay=st.sampled_from([0, 200_000]),
       jitter=st.sampled_from([0, 150_000]), only_testbed=st.booleans(),
       steps=st.lists(st.tuples(st.integers(0, 300_000),
                                st.lists(st.tuples(st.integers(0, len(_POOL) - 1),
                                                   st.integers(0, 1)), max_size=6)),
                      min_size=1, max_size=12))
def test_impair_kernel_matches_plain_python_twin(seed, loss, dup, reorder, k, delay, jitter,
                                                 only_testbed, steps):
    s = ImpairStage(n_ports=2, seed=seed, loss=loss, dup=dup, reorder=reorder, reorder_k=k,
                    delay_ms=delay / 1e6, jitter_ms=jitter / 1e6, reorder_timeout_ms=0.5,
                    slots=5, filter="testbed" if only_testbed else "all")
    twin = ImpairTwin(2, seed, loss, dup, reorder, k, delay, jitter, 500_000, 5, only_testbed)
    b = Batch(64)
    now = T0
    for dt, pk in steps:
        now += dt
        pkts = [(_POOL[i], p) for i, p in pk]
        b.reset()
        for f, p in pkts:
            i = b.alloc(1)
            b.buf[i, :len(f)] = np.frombuffer(f, np.uint8)
            b.length[i] = len(f)
            b.in_port[i] = 1 - p
            b.out_port[i] = p
        s.process(b, now)
        decisions, out = twin.process(pkts, now)
        assert [int(x) for x in b.out_port[:len(pkts)]] == decisions
        assert [(bytes(b.buf[i, :b.length[i]]), int(b.out_port[i]))
                for i in range(len(pkts), b.n)] == out
    assert s.held() == sum(e[0] for r in twin.ring for e in r)


# ---------------------------------------------------------------------------------------------
# Mininet: seeded loss and delay on a running switch


def _rtt(out: str) -> tuple[float, float]:
    """(min, avg) RTT in ms from ping's summary line."""
    line = next(ln for ln in out.splitlines() if "min/avg/max" in ln)
    lo, avg, *_ = line.split("=")[1].split()[0].split("/")
    return float(lo), float(avg)


@pytest.mark.mininet
def test_switch_impair_seeded_loss_is_reproducible_and_delay_adds_latency(tmp_path):
    from test_datapath_trim import (
        finish_capture,
        gen_done,
        host_frames,
        port_of,
        send_frames,
        start_capture,
    )

    from testbed.testing import programmable_star

    n = 1000
    with programmable_star(2, programs=[("forward", {}),
                                        ("impair", {"filter": "testbed"})]) as (_net, hosts, sw):
        h1, h2 = hosts
        p2 = port_of(sw, h2)
        idx2 = sw.port_names().index(p2)
        h = wire.new_headers(n)
        h["elem_count"] = 4
        h["chunk_offset"] = np.arange(n)
        fs = host_frames(h1, h2, [np.zeros(4, np.int32)] * n, h)
        runs = {}
        for name, seed in (("a", 7), ("b", 7), ("c", 8)):
            with sw.client() as c:
                c.configure("forward", l2={h2.MAC(): p2})
                c.configure("impair", seed=seed, loss={p2: 0.2})  # a new seed restarts streams
            cap, out = start_capture(h2, tmp_path, name)
            gen_done(send_frames(h1, fs, tmp_path, name, pps=5000), n)
            runs[name] = [number(f) for f in finish_capture(cap, out)]
        u = ref_uniform01(int(port_seed(7, idx2)), np.arange(n, dtype=np.int64) * 4)
        expected = [i for i in range(n) if u[i] >= 0.2]
        assert runs["a"] == expected  # exactly the documented seeded decisions, in order
        assert runs["b"] == runs["a"]  # same seed, same drops
        assert runs["c"] != runs["a"]
        sd = (n * 0.2 * 0.8) ** 0.5
        assert abs((n - len(runs["a"])) - 0.2 * n) < 5 * sd
        with sw.client() as c:
            lost = c.counters()["stages"]["impair"]["ports"][p2]["lost"]
            assert lost == 3 * n - sum(len(r) for r in runs.values())  # counted, all runs
            c.configure("impair", loss=0.0, filter="all")
        # the fastest undelayed ping: one slow reply on a loaded machine must not shift it
        base, _ = _rtt(h1.cmd("ping -q -c 5 -i 0.2", h2.IP()))
        with sw.client() as c:
            c.configure("impair", delay_ms={p2: 20.0})  # one way: h1 -> h2 only
        lo, avg = _rtt(h1.cmd("ping -q -c 5 -i 0.2", h2.IP()))
        assert lo >= 20.0 and 18.0 <= avg - base <= 30.0, (base, lo, avg)


def test_counters_say_what_the_stage_does_now():
    """The counters carry the stage's current settings per port (what the models price), and
    follow a change at run time."""
    st = ImpairStage(ports=["s1-eth1", "s1-eth2"], loss=0.01, filter="testbed",
                     reorder_timeout_ms=5.0)
    s = st.counters()["settings"]
    assert s["filter"] == "testbed" and s["reorder_timeout_ms"] == 5.0
    assert s["ports"]["s1-eth2"] == {"loss": 0.01, "dup": 0.0, "reorder": 0.0}
    st.configure(dup={"s1-eth2": 0.25}, reorder=0.5, filter="all")
    s = st.counters()["settings"]
    assert s["filter"] == "all"
    assert s["ports"]["s1-eth1"] == {"loss": 0.01, "dup": 0.0, "reorder": 0.5}
    assert s["ports"]["s1-eth2"] == {"loss": 0.01, "dup": 0.25, "reorder": 0.5}
