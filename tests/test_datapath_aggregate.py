"""Aggregation program: Numba kernel vs. the plain-Python twin, and real aggregation in Mininet."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.datapath.aggclient import header_bytes, udp_frame
from testbed.datapath.aggregate import (
    DEFAULT_AGG_IP,
    DEFAULT_AGG_MAC,
    THC_MAX_ELEMS,
    AggregateReference,
    AggregateStage,
)
from testbed.datapath.batch import PORT_HELD, PORT_UNSET, Batch, DropReason
from testbed.datapath.forward import ip_to_int, mac_to_int
from testbed.kernels.wire import HEADER_OFFSET, Codec, Flags, MsgType

AGG_MAC = mac_to_int(DEFAULT_AGG_MAC).to_bytes(6, "big")
AGG_IP = ip_to_int(DEFAULT_AGG_IP).to_bytes(4, "big")
JOBS = {1: (3, 2), 2: (2, 1)}  # job -> (n_workers, slots)


def _frame(job, worker, k, slots, elems, rng, mt=MsgType.DATA, bad=None):
    vals = rng.integers(-(2**31), 2**31, size=elems, dtype=np.int64).astype(np.int32)
    hdr = header_bytes(int(mt), job, worker, k % slots, (k // slots) % 2, 3, elems,
                       k * elems, exponent=int(rng.integers(-5, 5)))
    data = hdr + vals.tobytes()
    mac = bytes([2, 0, 0, 0, job, worker])
    ip = bytes([10, job, 0, worker + 1])
    f = bytearray(udp_frame(mac, AGG_MAC, ip, AGG_IP, 5000 + worker, 41000, data))
    if bad == "magic":
        f[HEADER_OFFSET] ^= 0xFF
    elif bad == "trunc":
        f = f[: len(f) - 4]
    elif bad == "type":
        f[HEADER_OFFSET + 3] = 9
    elif bad == "slot":
        f[HEADER_OFFSET + 8] = 200
    elif bad == "job":
        f[HEADER_OFFSET + 4] = 77
    elif bad == "worker":
        f[HEADER_OFFSET + 6] = 31
    elif bad == "options":
        f[14] = 0x46
    elif bad == "elems":
        f[HEADER_OFFSET + 18] += 1
    return bytes(f)


def _stage():
    jobs = {j: {"n_workers": n, "slots": s} for j, (n, s) in JOBS.items()}
    return AggregateStage(ports=["p0", "p1", "p2"], pool_slots=8, max_elems=16, jobs=jobs)


def _reference(stage):
    jobs = {j: (v["base"], v["slots"], v["n_workers"]) for j, v in stage.jobs.items()}
    return AggregateReference(DEFAULT_AGG_MAC, DEFAULT_AGG_IP, jobs, max_elems=16)


def _run_kernel(stage, frames, ports):
    b = Batch(len(frames) * 4 + 4)
    for i, (f, p) in enumerate(zip(frames, ports, strict=True)):
        b.buf[i, : len(f)] = np.frombuffer(f, np.uint8)
        b.length[i] = len(f)
        b.in_port[i] = p
    b.n = len(frames)
    stage.process(b, 0)
    decisions = [(int(b.out_port[i]), int(b.reason[i])) for i in range(len(frames))]
    results = [(int(b.out_port[i]), bytes(b.buf[i, : b.length[i]]))
               for i in range(len(frames), b.n)]
    return decisions, results


event = st.tuples(
    st.sampled_from(sorted(JOBS)), st.integers(0, 2), st.integers(0, 5),
    st.sampled_from([MsgType.DATA, MsgType.RETRANSMIT]),
    st.sampled_from([None] * 6 + ["magic", "trunc", "type", "slot", "job", "worker",
                                  "options", "elems"]),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(event, min_size=1, max_size=40), st.integers(1, 8), st.integers(0, 2**31))
def test_kernel_matches_reference(events, burst, seed):
    """Random contributions, retransmissions and malformed packets: kernel == Python twin."""
    rng = np.random.default_rng(seed)
    stage = _stage()
    ref = _reference(stage)
    frames, ports = [], []
    for job, w, k, mt, bad in events:
        n, slots = JOBS[job]
        frames.append(_frame(job, w % (n + (bad == "worker")), k, slots, 4 + job, rng, mt, bad))
        ports.append(w % 3)
    for lo in range(0, len(frames), burst):
        fr, po = frames[lo : lo + burst], ports[lo : lo + burst]
        dec, res = _run_kernel(stage, fr, po)
        exp_dec, exp_res = [], []
        for f, p in zip(fr, po, strict=True):
            d, r, out = ref.process(f, p)
            exp_dec.append((d, r))
            exp_res.extend(out)
        assert dec == exp_dec
        assert res == exp_res


def _thc_frame(job, worker, k, slots, vals, mt=MsgType.DATA, codec=Codec.THC):
    vals = np.asarray(vals, dtype=np.int8)
    hdr = header_bytes(int(mt), job, worker, k % slots, (k // slots) % 2, 3, vals.size,
                       k * vals.size, exponent=k, codec=int(codec))
    mac = bytes([2, 0, 0, 0, job, worker])
    ip = bytes([10, job, 0, worker + 1])
    return udp_frame(mac, AGG_MAC, ip, AGG_IP, 5000 + worker, 41000, hdr + vals.tobytes())


def _lanes(frame):
    """(elem_count, lane bytes, flags, int64 values) of a RESULT frame."""
    ne = int.from_bytes(frame[HEADER_OFFSET + 16:HEADER_OFFSET + 18], "little")
    pl = len(frame) - HEADER_OFFSET - 28
    lane = pl // ne
    vals = np.frombuffer(frame, {1: "<i1", 2: "<i2", 4: "<i4"}[lane], ne, HEADER_OFFSET + 28) \
        if lane else np.zeros(0)
    return ne, lane, frame[HEADER_OFFSET + 11], vals.astype(np.int64)


@pytest.mark.parametrize("n", range(2, 9))
def test_thc_int8_lanes_exact_sums(n):
    """THC: n = 2..8 workers' int8 lanes summed exactly (int32 registers); the RESULT comes
    back in the narrowest lane that holds the sums; kernel == twin byte for byte, shadow answer
    included."""
    rng = np.random.default_rng(n)
    stage = AggregateStage(pool_slots=4, max_elems=16, jobs={5: {"n_workers": n, "slots": 2}})
    ref = AggregateReference(DEFAULT_AGG_MAC, DEFAULT_AGG_IP, {5: (0, 2, n)}, max_elems=16)
    # chunk 0: levels of THC (|v| <= 8) -> int8 result for n <= 8 (|sum| <= 64);
    # chunk 1: full int8 range -> needs int16 for n >= 2; both with 1024 lanes (4x the int32
    # packet's elements)
    for k, hi, ne in ((0, 8, 1024), (1, 127, 600)):
        vals = [rng.integers(-hi, hi + 1, ne) for _ in range(n)]
        vals[0][:2] = (-hi, hi)
        frames = [_thc_frame(5, w, k, 2, vals[w]) for w in range(n)]
        dec, res = _run_kernel(stage, frames, list(range(n)))
        exp = [ref.process(f, w) for w, f in enumerate(frames)]
        assert dec == [(d, r) for d, r, _ in exp] == [(PORT_HELD, 0)] * n
        assert res == [o for _, _, out in exp for o in out]
        want = np.sum(vals, axis=0, dtype=np.int64)
        lane = 1 if np.abs(want).max() <= 127 and want.min() >= -128 else 2
        assert len(res) == n
        for _port, fr in res:
            got_ne, got_lane, flags, got = _lanes(fr)
            assert (got_ne, got_lane, flags) == (ne, lane, 0)
            assert np.array_equal(got, want)
        # a lost result: the retransmission is answered from the shadow set, same bytes
        d2, r2 = _run_kernel(stage, [_thc_frame(5, n - 1, k, 2, vals[n - 1],
                                                MsgType.RETRANSMIT)], [n - 1])
        _, _, out = ref.process(_thc_frame(5, n - 1, k, 2, vals[n - 1], MsgType.RETRANSMIT),
                                n - 1)
        assert d2 == [(PORT_HELD, 0)] and r2 == out and _lanes(r2[0][1])[3].tolist() == \
            want.tolist()
    assert stage.counters()["contributions"] == 2 * n


def test_thc_overflow_flag_and_codec_checks():
    """Sums that fit no lane within the MTU -> OVERFLOW flag and no payload (never wrapped);
    a THC packet into an INT32 set is refused; THC length/limit checks; codecs setting."""
    stage = AggregateStage(pool_slots=2, max_elems=16, jobs={1: {"n_workers": 2, "slots": 2}})
    ref = AggregateReference(DEFAULT_AGG_MAC, DEFAULT_AGG_IP, {1: (0, 2, 2)}, max_elems=16)
    big = np.full(1024, 100, np.int8)  # sums 200: int16 x 1024 = 2048 B > MTU
    frames = [_thc_frame(1, w, 0, 2, big) for w in range(2)]
    dec, res = _run_kernel(stage, frames, [0, 1])
    assert res == [o for f, w in zip(frames, (0, 1), strict=True) for o in ref.process(f, w)[2]]
    for _, fr in res:
        ne, lane, flags, _ = _lanes(fr)
        assert (ne, lane, flags) == (1024, 0, int(Flags.OVERFLOW))
    # mixed codecs in one slot set: the second contribution is dropped, not added
    i32 = _frame(1, 0, 1, 2, 4, np.random.default_rng(0))
    t8 = _thc_frame(1, 1, 1, 2, np.ones(4, np.int8))
    dec, res = _run_kernel(stage, [i32, t8], [0, 1])
    assert dec == [(PORT_HELD, 0), (-2, int(DropReason.BAD_CODEC))] and res == []
    # more than THC_MAX_ELEMS lanes, or a length that is not elem_count bytes -> BAD_LENGTH
    too_many = _thc_frame(1, 0, 2, 2, np.ones(THC_MAX_ELEMS + 1, np.int8))
    short = bytearray(_thc_frame(1, 0, 2, 2, np.ones(8, np.int8)))
    short[HEADER_OFFSET + 16] = 9
    for f in (too_many, bytes(short)):
        assert _run_kernel(stage, [f], [0])[0] == [(-2, int(DropReason.BAD_LENGTH))]
        assert ref.process(f, 0)[:2] == (-2, int(DropReason.BAD_LENGTH))
    # an INT32-only switch refuses THC
    only = AggregateStage(pool_slots=2, max_elems=16, codecs=["INT32"],
                          jobs={1: {"n_workers": 2, "slots": 2}})
    assert only.values.shape[2] == 16  # no THC registers allocated
    assert _run_kernel(only, [t8], [1])[0] == [(-2, int(DropReason.BAD_CODEC))]
    only.configure(codecs=["INT32", "THC"])
    assert only.values.shape[2] == THC_MAX_ELEMS


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(1, 40),
                          st.sampled_from([MsgType.DATA, MsgType.RETRANSMIT]),
                          st.sampled_from([Codec.THC] * 4 + [Codec.INT32])),
                min_size=1, max_size=30), st.integers(1, 6), st.integers(0, 2**31))
def test_thc_kernel_matches_reference(events, burst, seed):
    """Random THC/INT32 contributions and retransmissions (varying lane counts, so element
    mismatches too): kernel == Python twin, decisions and RESULT bytes."""
    rng = np.random.default_rng(seed)
    stage = _stage()
    ref = _reference(stage)
    frames, ports = [], []
    for w, k, ne, mt, codec in events:
        if codec == Codec.THC:
            frames.append(_thc_frame(1, w, k, 2, rng.integers(-128, 128, ne), mt))
        else:
            frames.append(_frame(1, w, k, 2, min(ne, 16), rng, mt))
        ports.append(w)
    for lo in range(0, len(frames), burst):
        fr, po = frames[lo:lo + burst], ports[lo:lo + burst]
        dec, res = _run_kernel(stage, fr, po)
        exp = [ref.process(f, p) for f, p in zip(fr, po, strict=True)]
        assert dec == [(d, r) for d, r, _ in exp]
        assert res == [o for _, _, out in exp for o in out]


def test_complete_aggregation_sum_and_shadow_answer():
    """3 workers, one slot: exact int32 sum to each worker; a late retransmission is answered."""
    rng = np.random.default_rng(1)
    stage = _stage()
    frames = [_frame(1, w, 0, 2, 8, rng) for w in range(3)]
    dec, res = _run_kernel(stage, frames, [0, 1, 2])
    assert [d for d, _ in dec] == [PORT_HELD] * 3
    expect = sum(np.frombuffer(f, "<i4", 8, HEADER_OFFSET + 28).astype(np.int64) for f in frames)
    expect = expect.astype(np.int32)  # int32 wrap, like the switch ALU
    assert sorted(p for p, _ in res) == [0, 1, 2]
    for _, r in res:
        assert np.array_equal(np.frombuffer(r, "<i4", 8, HEADER_OFFSET + 28), expect)
        assert r[HEADER_OFFSET + 3] == MsgType.RESULT
    # worker 1 lost its result and retransmits -> answered from the (complete) set
    dec, res = _run_kernel(stage, [_frame(1, 1, 0, 2, 8, rng, MsgType.RETRANSMIT)], [1])
    assert dec == [(PORT_HELD, 0)] and len(res) == 1 and res[0][0] == 1
    assert np.array_equal(np.frombuffer(res[0][1], "<i4", 8, HEADER_OFFSET + 28), expect)
    assert stage.counters()["retransmissions_answered"] == 1


def test_not_for_aggregator_falls_through_and_arp_answered():
    """Other traffic is left to later stages; ARP for the aggregator IP is answered in place."""
    stage = _stage()
    other = udp_frame(b"\x02\0\0\0\0\1", b"\x02\0\0\0\0\2", bytes([10, 0, 0, 1]),
                      bytes([10, 0, 0, 2]), 1, 41000, b"x" * 40)
    arp = (b"\xff" * 6 + b"\x02\0\0\0\0\1" + b"\x08\x06" + bytes.fromhex("0001080006040001")
           + b"\x02\0\0\0\0\1" + bytes([10, 0, 0, 1]) + b"\0" * 6 + AGG_IP)
    dec, res = _run_kernel(stage, [other, arp], [0, 2])
    assert dec[0] == (PORT_UNSET, 0)
    assert dec[1] == (2, 0)


def test_job_partitions_and_bad_config():
    """Jobs get disjoint partitions; over-asking and bad values give clear errors."""
    stage = AggregateStage(ports=["a"], pool_slots=10, max_elems=8)
    stage.configure(jobs={"5": {"n_workers": 2, "slots": 6}})
    with pytest.raises(ValueError, match="only 4 are free"):
        stage.configure(jobs={6: {"n_workers": 2, "slots": 5}})
    stage.configure(jobs={6: {"n_workers": 2, "slots": 4}})
    assert stage.jobs[5]["base"] + 6 <= stage.jobs[6]["base"]
    stage.configure(remove_jobs=[5])
    assert stage.free_slots() == 6
    with pytest.raises(ValueError, match="n_workers"):
        stage.add_job(7, 33, 1)
    with pytest.raises(ValueError, match="unknown settings"):
        stage.configure(slotz=3)
    with pytest.raises(ValueError, match="max_elems"):
        AggregateStage(max_elems=10_000)
    with pytest.raises(ValueError, match="no job 9"):
        stage.reset_job(9)


# ------------------------------------------------------------------------------ Mininet
import subprocess  # noqa: E402
import sys  # noqa: E402

from testbed.datapath.aggclient import worker_input  # noqa: E402

SEED = 20261129


@pytest.fixture(scope="module")
def star8():
    """8 hosts around one switch running aggregate + forward (built once for this module)."""
    from testbed.datapath.nodes import programmable_star

    with programmable_star(8, programs=[("aggregate", {"pool_slots": 256}),
                                        ("forward", {})]) as (net, hosts, sw):
        yield net, hosts, sw


def _start_workers(hosts, job, n, slots, length, tmp, loss=0.0, die=None, deadline=60.0):
    procs = []
    for w in range(n):
        args = [sys.executable, "-m", "testbed.datapath.aggclient", "--job", str(job),
                "--worker", str(w), "--n", str(n), "--slots", str(slots), "--length",
                str(length), "--seed", str(SEED), "--loss", str(loss), "--deadline",
                str(deadline), "--out", str(tmp / f"j{job}w{w}.npy")]
        if die is not None and die[0] == w:
            args += ["--die-after", str(die[1])]
        procs.append(hosts[w].popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def _check_job(procs, job, n, length, tmp):
    expect = sum(worker_input(SEED, job, w, length, n).astype(np.int64) for w in range(n))
    stats = []
    for w, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"job {job} worker {w}: {err.decode()[-2000:]}"
        got = np.load(tmp / f"j{job}w{w}.npy")
        assert got.dtype == np.int32
        assert np.array_equal(got.astype(np.int64), expect), f"job {job} worker {w} wrong sum"
        stats.append(__import__("json").loads((tmp / f"j{job}w{w}.json").read_text()))
    return stats


@pytest.mark.mininet
@pytest.mark.parametrize("n", range(2, 9))
def test_exact_sum_n_workers(star8, n, tmp_path):
    """n = 2..8 workers on real UDP sockets: every element is the exact int32 sum."""
    _net, hosts, sw = star8
    job = 10 + n
    with sw.client() as c:
        c.configure("aggregate", jobs={job: {"n_workers": n, "slots": 8}})
        try:
            stats = _check_job(_start_workers(hosts, job, n, 8, 3000, tmp_path), job, n, 3000,
                               tmp_path)
            agg = c.counters()["stages"]["aggregate"]
        finally:
            c.configure("aggregate", remove_jobs=[job])
    chunks = -(-3000 // 256)
    assert all(s["results"] == chunks for s in stats)
    assert agg["completed"] >= chunks


@pytest.mark.mininet
@pytest.mark.parametrize("loss", [0.01, 0.1])
def test_loss_recovered_by_retransmission(star8, loss, tmp_path):
    """Seeded loss of contributions and results: retransmissions (answered from the shadow
    set when the slot completed) recover, and the sum is still exact."""
    _net, hosts, sw = star8
    job, n = 40, 4
    with sw.client() as c:
        c.configure("aggregate", jobs={job: {"n_workers": n, "slots": 8}})
        before = c.counters()["stages"]["aggregate"]
        try:
            stats = _check_job(_start_workers(hosts, job, n, 8, 256 * 100, tmp_path, loss=loss),
                               job, n, 256 * 100, tmp_path)
            after = c.counters()["stages"]["aggregate"]
        finally:
            c.configure("aggregate", remove_jobs=[job])
    lost_tx = sum(s["lost_tx"] for s in stats)
    lost_rx = sum(s["lost_rx"] for s in stats)
    assert lost_tx + lost_rx > 0  # the seeded loss really happened
    assert sum(s["retransmitted"] for s in stats) > 0
    if lost_rx:
        answered = after["retransmissions_answered"] - before["retransmissions_answered"]
        assert answered > 0


@pytest.mark.mininet
def test_two_jobs_concurrently_never_mix(star8, tmp_path):
    """Two jobs share the switch at once on disjoint partitions; each gets its own sum."""
    _net, hosts, sw = star8
    with sw.client() as c:
        c.configure("aggregate", jobs={101: {"n_workers": 4, "slots": 8},
                                       102: {"n_workers": 4, "slots": 8}})
        try:
            pa = _start_workers(hosts[:4], 101, 4, 8, 5000, tmp_path)
            pb = _start_workers(hosts[4:], 102, 4, 8, 5000, tmp_path)
            _check_job(pa, 101, 4, 5000, tmp_path)
            _check_job(pb, 102, 4, 5000, tmp_path)
        finally:
            c.configure("aggregate", remove_jobs=[101, 102])


@pytest.mark.mininet
def test_dead_worker_does_not_wedge_others(star8, tmp_path):
    """A worker dies mid-aggregation: its job stalls, another job completes meanwhile;
    reset_job frees the stalled job, which then aggregates exactly."""
    _net, hosts, sw = star8
    with sw.client() as c:
        c.configure("aggregate", jobs={201: {"n_workers": 3, "slots": 4},
                                       202: {"n_workers": 3, "slots": 4}})
        try:
            dying = _start_workers(hosts[:3], 201, 3, 4, 256 * 20, tmp_path, die=(2, 6),
                                   deadline=4.0)
            other = _start_workers(hosts[3:6], 202, 3, 4, 256 * 20, tmp_path)
            _check_job(other, 202, 3, 256 * 20, tmp_path)
            codes = [p.wait(60) for p in dying]
            assert codes[2] == 3 and codes[0] != 0 and codes[1] != 0  # died / timed out
            assert c.counters()["stages"]["aggregate"]["stale"] > 0  # survivors' retries
            c.reset_job(201)
            _check_job(_start_workers(hosts[:3], 201, 3, 4, 256 * 20, tmp_path), 201, 3,
                       256 * 20, tmp_path)
        finally:
            for p in dying:
                if p.poll() is None:
                    p.kill()
            c.configure("aggregate", remove_jobs=[201, 202])


def test_results_via_forward_leaves_routing_to_forward():
    """results_via='forward': RESULT rows are left undecided for the forward stage."""
    stage = _stage()
    stage.configure(results_via="forward")
    rng = np.random.default_rng(2)
    dec, res = _run_kernel(stage, [_frame(2, w, 0, 1, 8, rng) for w in range(2)], [0, 1])
    assert [d for d, _ in dec] == [PORT_HELD, PORT_HELD]
    assert [p for p, _ in res] == [PORT_UNSET, PORT_UNSET]
    with pytest.raises(ValueError, match="results_via"):
        stage.configure(results_via="multicast")
