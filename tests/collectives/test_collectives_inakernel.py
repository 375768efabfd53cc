"""The INA worker kernels against their plain-Python twin on synthetic RESULT bursts (valid
results in random order, duplicates, late answers, other jobs, truncated datagrams, seeded
drops, timer expiries), fast retransmission and timeouts, and the THC packet maths."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.collectives import inakernel as ik
from testbed.collectives.reference import inakernel as ref
from testbed.kernels.compressors.thc import rht_forward, rht_inverse
from testbed.kernels.wire import HEADER_LEN, Codec, Flags, MsgType, pack_header, unpack_header

JOB, N, RANK = 7, 3, 1


def make(mode, W, count, seed=0, seq0=5, blk=256, E=None):
    """(slots, loop, payload) for one worker, and an identical deep copy for the twin."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(count) * 3).astype(np.float32)
    x[256:512] = 0.0  # an all-zero chunk: exponent EXP_MIN / THC_EXP_ZERO
    z = np.uint64(0)
    if mode == ik.MODE_THC:
        E = E or 1024
        d = -(-count // blk) * blk
        K = -(-d // E)
        p = ik.Payload(mode, x, np.full(count, np.nan, np.float32), np.zeros(d, np.int32),
                       np.full(max(K, 1), ik.THC_EXP_ZERO, np.int16), K, W, E, d, N, JOB, RANK,
                       4.0, 8.0, blk, np.uint64(777), np.uint64(12345),
                       np.zeros(ik.THC_ELEMS, np.float32))
    else:
        K = -(-count // ik.ELEMS)
        nic = mode == ik.MODE_NIC
        p = ik.Payload(mode, x, np.full(count, np.nan, np.float32), np.zeros(count, np.int32),
                       np.full(max(K, 1), -149, np.int16), K, 0 if nic else W, ik.ELEMS, count,
                       N, JOB, RANK, 0.0, 1.0, 1, z, z, np.zeros(ik.THC_ELEMS, np.float32))
    state = (ik.new_slots(W, seq0), ik.new_loop(0.0), p)
    return state, copy.deepcopy(state)


def assert_same(a, b):
    (sa, la, pa), (sb, lb, pb) = a, b
    for name in sa._fields:
        assert np.array_equal(getattr(sa, name), getattr(sb, name)), name
    assert la.tobytes() == lb.tobytes()
    for name in ("out", "qsum", "agreed"):
        assert np.array_equal(getattr(pa, name), getattr(pb, name), equal_nan=True), name


def on_burst(state, rbuf, rlen, nrecv, drop, now, send_list, gso=ik.SEND_GSO):
    """The client's burst kernel (:func:`ik.on_burst`, its arrays in one table) on a burst
    whose lengths ``recvmmsg`` left in the ``mmsghdr`` rows: ``(done, nsend, ignored, lost,
    bad_slot, code)`` as the twin's :func:`on_results` returns them. Checks what it built
    for the sends against the twin: an ``iovec`` per listed packet and, with ``gso``, the
    GSO groups of :func:`gso_batches`."""
    from testbed.kernels.packed import array_table

    slots, loop, p = state
    W, B = slots.cur.size, rbuf.shape[0]
    rhdr = np.zeros((B, 8), np.uint64)
    rhdr[:, 7] = rlen.astype(np.uint64) | np.uint64(0xABC << 32)  # msg_len, and padding
    siov, ghdr, gctl = np.zeros((W, 2), np.uint64), np.zeros((W, 8), np.uint64), \
        np.zeros((W, 3), np.uint64)
    arrays = ik.burst_arrays(rbuf, rhdr, np.zeros(B, np.int64), drop, slots, p, send_list,
                             siov, ghdr, gctl)
    d, ns, g, ign, lost, bad, code, earliest = ik.on_burst(
        array_table(arrays, ik.BURST_SPEC), loop, ik.payload_scalars(p), nrecv, now, gso,
        15000, 64, 42)
    rows = send_list[:ns]
    built = ns if gso != ik.SEND_NONE and bad < 0 else 0
    assert np.array_equal(siov[:built, 0], np.uint64(slots.pkts.ctypes.data)
                          + rows[:built].astype(np.uint64) * np.uint64(ik.ROW))
    assert np.array_equal(siov[:built, 1], slots.lens[rows[:built]].astype(np.uint64))
    want = np.zeros((W, 8), np.uint64), np.zeros((W, 3), np.uint64)
    groups = ref.gso_batches(rows, ns, slots.lens, np.uint64(siov.ctypes.data), *want, 15000,
                             64, 42) if gso == ik.SEND_GSO and ns and bad < 0 else 0
    assert g == groups and np.array_equal(ghdr, want[0]) and np.array_equal(gctl, want[1])
    assert earliest == slots.deadline.min()
    return d, ns, ign, lost, bad, code


def result(rng, state, s, *, job=JOB, seq_delta=0, chunk_delta=0, lane=None, flags=0):
    """A RESULT for slot ``s``'s outstanding packet (or a corrupted variant)."""
    slots, _, p = state
    j = int(slots.cur[s])
    off = ik.BOOT_OFFSET if j < p.boot else (j - p.boot) * p.E
    ne = 1 if j < p.boot else min(p.E, p.d - off)
    if p.mode == ik.MODE_THC:
        lane = lane or int(rng.choice([v for v in (1, 2, 4) if v * ne <= 1436]))
        hi = {1: 127, 2: 3000, 4: 1 << 20}[lane]
        vals = rng.integers(-hi, hi + 1, ne).astype({1: "<i1", 2: "<i2", 4: "<i4"}[lane])
        e, codec = int(rng.integers(-40, 60)), Codec.THC
    elif p.mode == ik.MODE_NIC:
        vals, e, codec = rng.standard_normal(ne).astype("<f4"), 0, Codec.FLOAT32
    else:
        vals = rng.integers(-(1 << 30), 1 << 30, ne).astype("<i4")
        e, codec = int(rng.integers(6, 20)), Codec.INT32
    hdr = pack_header(msg_type=int(MsgType.RESULT), job_id=job, worker_id=RANK, slot=s,
                      slot_set=(int(slots.seq[s]) + seq_delta) & 1, flags=flags,
                      codec=int(codec), n_workers=N, exponent=e, elem_count=ne,
                      chunk_offset=(off + chunk_delta) & 0xFFFFFFFF,
                      seq=(int(slots.seq[s]) + seq_delta) & 0xFFFFFFFF)
    return hdr + (b"" if flags else vals.tobytes())


@pytest.mark.parametrize("mode, count, W", [(ik.MODE_INT32, 256 * 5 + 17, 4),
                                            (ik.MODE_NIC, 256 * 3 + 1, 3),
                                            (ik.MODE_INT32, 100, 8),
                                            (ik.MODE_THC, 5000, 4), (ik.MODE_THC, 700, 8)])
def test_kernel_matches_twin(mode, count, W):
    rng = np.random.default_rng(count)
    a, b = make(mode, W, count, seq0=(1 << 32) - 2)  # rounds wrap around during the run
    sl = np.zeros(W, np.int64), np.zeros(W, np.int64)
    ka = ik.start(a[0], a[1], a[2], 0.0, sl[0])
    kb = ref.start(b[0], b[1], b[2], 0.0, sl[1])
    assert ka == kb and np.array_equal(sl[0], sl[1])
    assert_same(a, b)
    total = a[2].K + a[2].boot
    rbuf = np.zeros((16, 2048), np.uint8)
    done, now = 0, 0.0
    while done < total:
        now += 0.004
        live = [s for s in range(W) if a[0].cur[s] >= 0]
        msgs = [result(rng, a, s) for s in rng.permutation(live)][:rng.integers(1, W + 1)]
        # junk: another job, the previous round (a duplicate), the next round, a wrong chunk,
        # a truncated datagram
        s0 = live[0]
        msgs += [result(rng, a, s0, job=JOB + 1), result(rng, a, s0, seq_delta=-1),
                 result(rng, a, s0, seq_delta=1), result(rng, a, s0, chunk_delta=256),
                 result(rng, a, s0)[:HEADER_LEN - 2]]
        msgs = [msgs[i] for i in rng.permutation(len(msgs))][:16]
        rlen = np.zeros(16, np.int64)
        for i, m in enumerate(msgs):
            rbuf[i, :len(m)] = np.frombuffer(m, np.uint8)
            rlen[i] = len(m)
        drop = rng.random(16) < 0.15
        # the kernel side through the client's entry point (its arrays as one table)
        ra = on_burst(a, rbuf, rlen, len(msgs), drop, now, sl[0],
                      gso=(ik.SEND_GSO, ik.SEND_EACH, ik.SEND_NONE)[rng.integers(3)])
        rb = ref.on_results(rbuf, rlen, len(msgs), drop, b[0], b[1], b[2], now, sl[1])
        assert tuple(int(v) for v in ra) == tuple(int(v) for v in rb)
        assert ra[4] == -1 and ra[2] >= 4  # no protocol error; the junk was ignored
        assert np.array_equal(sl[0][:ra[1]], sl[1][:rb[1]])
        assert_same(a, b)
        done += ra[0]
        if rng.random() < 0.3:  # a timer check
            ea = ik.expire_flat(tuple(a[0]), a[1], now + 0.05, sl[0])
            eb = ref.expire(b[0], b[1], now + 0.05, sl[1])
            assert ea == eb and np.array_equal(sl[0][:ea], sl[1][:eb])
            assert_same(a, b)
    assert (a[0].cur == -1).all()
    if mode == ik.MODE_THC:  # per-packet decode == descale + whole-vector inverse transform
        p = a[2]
        y = np.empty(p.d, np.float32)
        ik.thc_descale(p.qsum, p.agreed, p.E, p.clip, p.half, y)
        whole = np.empty(p.x.size, np.float32)
        rht_inverse.serial(y, p.blk, p.skey, p.x.size, whole)
        assert np.array_equal(p.out, whole)
    if mode == ik.MODE_INT32:  # the client's last step, the whole vector in one call
        ik.dequantize_int32(a[2])
        ref.dequantize_int32(b[2])
        assert_same(a, b)


@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 256 * 9), n=st.integers(1, 64), seed=st.integers(0, 2**32 - 1))
def test_dequantize_int32_matches_twin_at_every_exponent(count, n, seed):
    """The whole-vector dequantisation against the twin: chunks at the extreme agreed
    exponents (EXP_MIN, EXP_MAX: results past float32's range are inf), the int32 extremes,
    a short last chunk."""
    rng = np.random.default_rng(seed)
    (_, _, p), (_, _, q) = make(ik.MODE_INT32, 4, count)
    p.qsum[:] = rng.integers(-(1 << 31), 1 << 31, count, dtype=np.int64).astype(np.int32)
    p.qsum[:2] = (-(1 << 31), (1 << 31) - 1)[:count]
    p.agreed[:] = rng.choice(np.array([-149, -60, 0, 7, 40, 127, 128]), p.K)
    p = p._replace(n=n)
    q = q._replace(n=n, qsum=p.qsum.copy(), agreed=p.agreed.copy())
    ik.dequantize_int32(p)
    ref.dequantize_int32(q)
    assert np.array_equal(p.out, q.out, equal_nan=True)
    assert not np.isnan(p.out).any()


def test_packets_carry_the_round_and_the_protocol_fields():
    a, b = make(ik.MODE_INT32, 4, 3000, seq0=(1 << 32) - 1)
    sl = np.zeros(4, np.int64)
    ik.start(a[0], a[1], a[2], 0.0, sl)
    for s in range(4):
        h = unpack_header(a[0].pkts[s].tobytes())
        assert (h["msg_type"], h["job_id"], h["worker_id"], h["slot"]) == (MsgType.DATA, JOB,
                                                                           RANK, s)
        assert (h["seq"], h["slot_set"], h["chunk_offset"]) == ((1 << 32) - 1, 1, ik.BOOT_OFFSET)
    assert a[1][0]["sends"] == 4


def test_mismatched_result_and_thc_overflow_are_reported():
    """A RESULT for the outstanding packet whose size or codec does not fit it -> code 1;
    THC's OVERFLOW flag -> code 2 (the client raises with the slot)."""
    rng = np.random.default_rng(1)
    for mode, tweak, code in ((ik.MODE_NIC, "ne", 1), (ik.MODE_INT32, "codec", 1),
                              (ik.MODE_THC, "overflow", 2), (ik.MODE_THC, "lane3", 1)):
        (slots, loop, p), _ = make(mode, 2, 2048)
        sl = np.zeros(2, np.int64)
        ik.start(slots, loop, p, 0.0, sl)
        if p.boot:  # answer the bootstrap round first so slot 0 waits for data
            for s in range(2):
                m = result(rng, (slots, loop, p), s)
                rb = np.zeros((1, 4096), np.uint8)
                rb[0, :len(m)] = np.frombuffer(m, np.uint8)
                ik.on_results(rb, np.array([len(m)]), 1, np.zeros(1, np.bool_), slots, loop, p,
                              0.0, sl)
        m = bytearray(result(rng, (slots, loop, p), 0,
                             flags=int(Flags.OVERFLOW) if tweak == "overflow" else 0,
                             lane=1 if mode == ik.MODE_THC else None))
        h = unpack_header(m)
        if tweak == "ne":
            h["elem_count"] -= 1
        elif tweak == "codec":
            h["codec"] = int(Codec.FLOAT32)
        elif tweak == "lane3":
            extra = 2 * int(h["elem_count"])
            del h
            m += bytes(extra)
        rb = np.zeros((1, 4096), np.uint8)
        rb[0, :len(m)] = np.frombuffer(bytes(m), np.uint8)
        r = ik.on_results(rb, np.array([len(m)]), 1, np.zeros(1, np.bool_), slots, loop, p,
                          0.0, sl)
        assert (r[4], r[5]) == (0, code), (mode, tweak)


def test_fast_retransmission_and_timeouts():
    """A packet overtaken by FAST_RETX later-sent answered packets is resent once as
    RETRANSMIT (no timer wait); an unanswered packet is resent at its deadline with a doubled
    timeout, capped at T_MAX; answered slots take an RTT sample (not after a resend)."""
    W = 8
    (slots, loop, p), _ = make(ik.MODE_NIC, W, 256 * 40)
    sl = np.zeros(W, np.int64)
    ik.start(slots, loop, p, 0.0, sl)
    rng = np.random.default_rng(0)
    rb = np.zeros((8, 2048), np.uint8)
    msgs = [result(rng, (slots, loop, p), s) for s in range(1, 1 + ik.FAST_RETX)]
    for i, m in enumerate(msgs):
        rb[i, :len(m)] = np.frombuffer(m, np.uint8)
    r = ik.on_results(rb, np.array([len(m) for m in msgs]), len(msgs), np.zeros(8, np.bool_),
                      slots, loop, p, 0.002, sl)
    assert r[0] == ik.FAST_RETX
    # overtaken by 3 later packets, but not late yet: a slower member, or a longer path
    assert set(sl[:r[1]].tolist()) == set(range(1, 1 + ik.FAST_RETX))
    assert not slots.retx[0]
    late = ik.REORDER_SLACK * 0.002 + 1e-4
    r = ik.on_results(rb, np.zeros(8, np.int64), 0, np.zeros(8, np.bool_), slots, loop, p,
                      late, sl)
    assert sl[:r[1]].tolist() == [0]  # now it is: resent without waiting for its timer
    assert unpack_header(slots.pkts[0].tobytes())["msg_type"] == MsgType.RETRANSMIT
    assert slots.retx[0] and abs(loop[0]["srtt"] - 0.002) < 1e-12
    # the answer to the resent packet may be the original's: it proves nothing about the
    # packets sent before the resend (else each spurious resend makes the whole window look
    # lost, a cascade that collapsed congested fabrics), so it does not advance "answered"
    acked, rack = int(loop[0]["acked"]), float(loop[0]["rack_rtt"])
    m = result(rng, (slots, loop, p), 0)
    rb[0, :len(m)] = np.frombuffer(m, np.uint8)
    r = ik.on_results(rb, np.array([len(m)]), 1, np.zeros(8, np.bool_), slots, loop, p,
                      late + 0.05, sl)
    assert sl[:r[1]].tolist() == [0]  # slot 0's next packet, and no resend of slots 4..7
    assert (int(loop[0]["acked"]), float(loop[0]["rack_rtt"])) == (acked, rack)
    assert not slots.retx[0]
    # timers: every other outstanding packet expires at its deadline, timeout doubling
    before = slots.rto.copy()
    k = ik.expire(slots, loop, 10.0, sl)
    assert k == W
    assert np.allclose(slots.rto, np.minimum(2 * before, ik.T_MAX))
    for _ in range(10):
        ik.expire(slots, loop, 1e3 + _, sl)
    assert slots.rto.max() == ik.T_MAX


def test_backed_off_timeout_is_kept_until_a_clean_sample():
    """A slot whose packet was resent by its timer keeps the doubled timeout for its next
    packet (the answer's round trip is ambiguous); a clean round trip brings it back to the
    estimator's. Kernel and twin agree at every step."""
    W = 2
    (slots, loop, p), (rslots, rloop, rp) = make(ik.MODE_INT32, W, 256 * 12)
    sl, rsl = np.zeros(W, np.int64), np.zeros(W, np.int64)
    ik.start(slots, loop, p, 0.0, sl)
    ref.start(rslots, rloop, rp, 0.0, rsl)
    rng = np.random.default_rng(1)
    rb = np.zeros((1, 2048), np.uint8)

    def answer(s, now):
        m = result(rng, (slots, loop, p), s)
        rb[0, :len(m)] = np.frombuffer(m, np.uint8)
        ik.on_results(rb, np.array([len(m)]), 1, np.zeros(1, np.bool_), slots, loop, p, now, sl)
        ref.on_results(rb.copy(), np.array([len(m)]), 1, np.zeros(1, np.bool_), rslots, rloop,
                       rp, now, rsl)
        assert np.array_equal(slots.rto, rslots.rto) and np.array_equal(slots.retx, rslots.retx)

    answer(1, 0.001)  # slot 1: a clean 1 ms round trip: the timeout stays at its floor
    for t in (0.011, 0.032, 0.075):  # slot 0 times out three times: 10 -> 80 ms
        ik.expire(slots, loop, t, sl)
        ref.expire(rslots, rloop, t, rsl)
    assert slots.rto[0] == 8 * ik.T0
    answer(0, 0.09)  # answered after resends: ambiguous, the backoff stays
    assert slots.rto[0] == 8 * ik.T0 and not slots.retx[0]
    answer(0, 0.095)  # the next packet's clean 5 ms round trip: back to the estimator
    assert slots.rto[0] == pytest.approx(max(float(loop[0]["rto"]), 2 * 0.005))
    assert slots.rto[0] < 8 * ik.T0


# ----------------------------------------------------------------------------- THC maths


def test_rotate_chunk_matches_whole_vector_transform():
    """Per-packet rotation == thc.rht_forward over the whole vector, bit for bit."""
    x = np.random.default_rng(2).standard_normal(3000).astype(np.float32)
    whole = np.empty(3072, np.float32)
    rht_forward.serial(x, 512, np.uint64(99), whole)
    buf = np.empty(1024, np.float32)
    for lo in range(0, 3072, 1024):
        ik.rotate_chunk(x, lo, 1024, 512, np.uint64(99), buf)
        assert np.array_equal(buf, whole[lo:lo + 1024])


def test_thc_exponent_matches_twin_and_bounds_the_norm():
    assert ik.thc_exponent(np.zeros(4, np.float32), 0, 4) == ik.THC_EXP_ZERO
    for v in (1e-30, 0.3, 1.0, 7.5, 3e30):
        z = np.full(16, v, np.float32)
        assert ik.thc_exponent(z, 0, 16) == ref.thc_exponent(z, 0, 16)
        assert 2.0 ** (ik.thc_exponent(z, 0, 16) / ik.NORM_RES) >= 0.999999 * 4 * v


def test_thc_quantiser_unbiased_and_bounded():
    """The packet's int8 levels: within -half..half, at most one grid step from y/step, and
    unbiased over many independent streams (mean error << one step)."""
    E = 256
    (slots, loop, p), _ = make(ik.MODE_THC, 1, E, blk=E, E=E)
    y = np.empty(E, np.float32)
    ik.rotate_chunk(p.x, 0, E, E, p.skey, y)
    p.agreed[0] = ik.thc_exponent(p.x, 0, E)
    step = ik.thc_scale(int(p.agreed[0]), E, p.clip) / p.half
    acc = np.zeros(E)
    reps = 400
    for r in range(reps):
        q_p = p._replace(qkey=np.uint64(r * 7919 + 1))
        ik.build_packet(slots, 0, p.boot, q_p)  # data chunk 0
        q = slots.pkts[0, HEADER_LEN:HEADER_LEN + E].view(np.int8).astype(np.float64)
        assert np.abs(q).max() <= p.half
        assert np.all(np.abs(q * step - y) < step * (1 + 1e-9))
        acc += q * step
    assert np.abs(acc / reps - y).max() < 0.25 * step  # ~ 0.5 step / sqrt(400) * 5 sigma


def test_fair_share_window_of_a_shared_job():
    from testbed.collectives.ina import fair_share_slots

    assert fair_share_slots(32, 96, 0) == 12  # alone so far: the pool is for two at least
    assert fair_share_slots(32, 96, 1) == 12
    assert fair_share_slots(32, 96, 2) == 8
    assert fair_share_slots(8, 96, 0) == 8  # never more than asked
    assert fair_share_slots(32, 3, 5) == 1  # never none
    with pytest.raises(ValueError, match="asked=0"):
        fair_share_slots(0, 96, 0)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.sampled_from([1100, 1100, 1100, 1100, 700, 40, 1300]), min_size=1,
                      max_size=40),
       max_bytes=st.sampled_from([0, 1500, 15000, 65000]), max_segs=st.integers(1, 64))
def test_gso_batches_match_twin_and_keep_the_kernels_rule(sizes, max_bytes, max_segs):
    """Runs of UDP GSO sends: the kernel and its twin write the same headers, and every run is
    one the kernel's ``UDP_SEGMENT`` cuts back into exactly the packets listed, in order
    (all but the last as long as the first, within both caps unless alone)."""
    k = len(sizes)
    order = np.random.default_rng(k).permutation(k + 3)[:k].astype(np.int64)
    lens = np.zeros(k + 3, np.int64)
    lens[order] = sizes
    got, want = (np.zeros((k, 8), np.uint64), np.zeros((k, 3), np.uint64)), \
        (np.zeros((k, 8), np.uint64), np.zeros((k, 3), np.uint64))
    base = np.uint64(1 << 20)
    g = ik.gso_batches(order, k, lens, base, got[0], got[1], max_bytes, max_segs, 42)
    assert g == ref.gso_batches(order, k, lens, base, want[0], want[1], max_bytes, max_segs, 42)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    firsts = [(int(got[0][i, 2]) - int(base)) // 16 for i in range(g)]
    counts = [int(got[0][i, 3]) for i in range(g)]
    assert firsts == list(np.cumsum([0] + counts[:-1])) and sum(counts) == k
    for a, c, seg in zip(firsts, counts, got[1][:g, 2], strict=True):
        run = sizes[a:a + c]
        assert seg == run[0] and all(s == run[0] for s in run[:-1]) and run[-1] <= run[0]
        assert c == 1 or (c <= max_segs and c * (run[0] + 42) <= max_bytes)


def test_the_timeout_starts_from_the_path_and_the_last_collective():
    """A worker's timeout floor is the longer of SwitchML's 10 ms and twice the time its window
    takes to leave at the job's bottleneck share (the flow model's assumption); a collective's
    timeout starts from the last one's round trips, as a TCP connection keeps its estimator;
    the cap is never below the floor; every timer stretches with the dilation."""
    from testbed.collectives.ina import FRAME_OVERHEAD, timeout_floor

    frame_bits = (ik.ROW + FRAME_OVERHEAD) * 8
    assert timeout_floor(64, None) == timeout_floor(4, 100e6) == ik.T0
    assert timeout_floor(64, 100e6) == pytest.approx(2 * 64 * frame_bits / 100e6)  # 11 ms
    assert timeout_floor(64, 5e6) == pytest.approx(20 * timeout_floor(64, 100e6))  # 0.23 s
    fresh = ik.new_loop(0.0, dilation=3.0)[0]
    assert (fresh["rto"], fresh["t0"], fresh["tmax"]) == pytest.approx(
        (3 * ik.T0, 3 * ik.T0, 3 * ik.T_MAX))
    assert fresh["srtt"] == 0.0
    kept = ik.new_loop(0.0, dilation=3.0, rtt=(0.05, 0.01))[0]
    assert (kept["srtt"], kept["rttvar"], kept["rto"]) == pytest.approx((0.05, 0.01, 0.09))
    thin = ik.new_loop(0.0, dilation=2.0, t0=0.5, rtt=(0.05, 0.01))[0]
    assert (thin["t0"], thin["rto"], thin["tmax"]) == pytest.approx((1.0, 1.0, 1.0))
