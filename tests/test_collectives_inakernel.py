"""The batched INA worker kernel against its plain-Python twin, on synthetic RESULT bursts
(valid results in random order, duplicates, foreign and truncated datagrams, seeded drops)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from testbed.collectives import inakernel as ik
from testbed.kernels.wire import HEADER_LEN, MAGIC, VERSION, Codec, MsgType

HDR = struct.Struct("<HBBHHHBBBBhHHIf")


def _state(W, count, K, boot):
    pkts = np.zeros((W, ik.ROW), dtype=np.uint8)
    return {
        "pkts": pkts, "lens": np.zeros(W, np.int64), "qsum": np.zeros(count, np.int32),
        "out": np.zeros(count, np.float32), "agreed": np.full(max(K, 1), -149, np.int16),
        "cur": np.full(W, -1, np.int64), "uses": np.zeros(W, np.int64),
        "sent_at": np.zeros(W), "retx": np.zeros(W, np.bool_), "deadline": np.full(W, np.inf),
        "rto": np.full(W, ik.T0), "st": np.array([0.0, 0.0, ik.T0, 0.0]),
        "send_list": np.zeros(W, np.int64),
    }


def _views(s):
    return s["pkts"], s["pkts"].view(np.int32), s["pkts"].view(np.float32)


def _result(rng, s, slot, job, nic, boot, count, good=True):
    j = int(s["cur"][slot])
    off = ik.BOOT_OFFSET if j < boot else (j - boot) * 256
    ne = 1 if j < boot else min(256, count - off)
    codec = int(Codec.FLOAT32) if nic else int(Codec.INT32)
    sset = int(s["uses"][slot] & 1) if good else 1 - int(s["uses"][slot] & 1)
    e = int(rng.integers(6, 20))  # agreed exponents bound the data (|x| < 2**6 here)
    hdr = HDR.pack(MAGIC, VERSION, int(MsgType.RESULT), job, 0, slot, sset, 0, codec, 3, e, ne,
                   0, off, 0.0)
    if nic:
        pay = rng.standard_normal(ne).astype(np.float32).tobytes()
    else:
        pay = rng.integers(-(1 << 30), 1 << 30, ne).astype(np.int32).tobytes()
    return hdr + pay


@pytest.mark.parametrize("nic, count, W", [(False, 256 * 5 + 17, 4), (True, 256 * 3 + 1, 3),
                                           (False, 100, 8)])
def test_kernel_matches_twin(nic, count, W):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(count) * 3).astype(np.float32)
    x[256:512] = 0.0  # an all-zero chunk: exponent EXP_MIN
    K = -(-count // 256)
    boot = 0 if nic else W
    total = K + boot
    job, n = 7, 3
    a, b = _state(W, count, K, boot), _state(W, count, K, boot)
    for s in range(min(W, total)):
        la = ik.build_packet(*_views(a), s, s, x, K, boot, n, job, 1, 0, a["agreed"], nic)
        lb = ik.build_packet_ref(*_views(b), s, s, x, K, boot, n, job, 1, 0, b["agreed"], nic)
        assert la == lb
        for st in (a, b):
            st["lens"][s], st["cur"][s] = la, s
    assert np.array_equal(a["pkts"], b["pkts"])
    rbuf = np.zeros((16, 2048), np.uint8)
    done = 0
    now = 0.0
    while done < total:
        now += 0.001
        live = [s for s in range(W) if a["cur"][s] >= 0]
        msgs = [_result(rng, a, s, job, nic, boot, count) for s in rng.permutation(live)]
        # junk: another job, the wrong set (a stale duplicate), a truncated datagram
        msgs.append(_result(rng, a, live[0], job + 1, nic, boot, count))
        msgs.append(_result(rng, a, live[0], job, nic, boot, count, good=False))
        msgs.append(msgs[0][:HEADER_LEN - 2])
        msgs = msgs[:16]
        rlen = np.zeros(16, np.int64)
        for i, m in enumerate(msgs):
            rbuf[i, :len(m)] = np.frombuffer(m, np.uint8)
            rlen[i] = len(m)
        drop = rng.random(16) < 0.2
        ra = ik.on_results(rbuf, rbuf.view(np.int32), rbuf.view(np.float32), rlen, len(msgs),
                           drop, *_views(a), a["lens"], x, a["qsum"], a["out"], a["agreed"],
                           a["cur"], a["uses"], a["sent_at"], a["retx"], a["deadline"],
                           a["rto"], a["st"], now, K, boot, W, n, job, 1, nic, a["send_list"])
        rb = ik.on_results_ref(rbuf, rbuf.view(np.int32), rbuf.view(np.float32), rlen,
                               len(msgs), drop, *_views(b), b["lens"], x, b["qsum"], b["out"],
                               b["agreed"], b["cur"], b["uses"], b["sent_at"], b["retx"],
                               b["deadline"], b["rto"], b["st"], now, K, boot, W, n, job, 1,
                               nic, b["send_list"])
        assert tuple(int(v) for v in ra) == tuple(int(v) for v in rb)
        assert ra[4] == -1 and ra[2] >= 2  # no protocol error; the junk was ignored
        for key in a:
            assert np.array_equal(a[key], b[key]), key
        done += ra[0]
    assert (a["cur"] == -1).all()


def test_kernel_flags_a_wrong_chunk_offset():
    W, count, K = 2, 600, 3
    s = _state(W, count, K, 0)
    x = np.ones(count, np.float32)
    for slot in range(W):
        s["lens"][slot] = ik.build_packet(*_views(s), slot, slot, x, K, 0, 2, 1, 0, 0,
                                          s["agreed"], True)
        s["cur"][slot] = slot
    # right offset (chunk 1 = 256) but 300 elements: would overrun the 600-element result
    m = HDR.pack(MAGIC, VERSION, int(MsgType.RESULT), 1, 0, 1, 0, 0, int(Codec.FLOAT32), 2, 0,
                 300, 0, 256, 0.0) + bytes(1200)
    rbuf = np.zeros((1, 2048), np.uint8)
    rbuf[0, :len(m)] = np.frombuffer(m, np.uint8)
    r = ik.on_results(rbuf, rbuf.view(np.int32), rbuf.view(np.float32),
                      np.array([len(m)], np.int64), 1, np.zeros(1, np.bool_), *_views(s),
                      s["lens"], x, s["qsum"], s["out"], s["agreed"], s["cur"], s["uses"],
                      s["sent_at"], s["retx"], s["deadline"], s["rto"], s["st"], 0.0, K, 0, W,
                      2, 1, 0, True, s["send_list"])
    assert r[4] == 1


# ----------------------------------------------------------------------------- INA + THC


def _thc_state(W, d, K):
    return {
        "pkts": np.zeros((W, ik.ROW), np.uint8), "lens": np.zeros(W, np.int64),
        "qsum": np.zeros(d, np.int32), "agreed": np.full(max(K, 1), ik.THC_EXP_ZERO, np.int16),
        "cur": np.full(W, -1, np.int64), "uses": np.zeros(W, np.int64), "sent_at": np.zeros(W),
        "retx": np.zeros(W, np.bool_), "deadline": np.full(W, np.inf),
        "rto": np.full(W, ik.T0), "st": np.array([0.0, 0.0, ik.T0, 0.0]),
        "send_list": np.zeros(W, np.int64),
    }


def _thc_result(rng, s, slot, job, boot, E, d, good=True, lane=None, flags=0):
    j = int(s["cur"][slot])
    off = ik.BOOT_OFFSET if j < boot else (j - boot) * E
    ne = 1 if j < boot else min(E, d - off)
    sset = int(s["uses"][slot] & 1) if good else 1 - int(s["uses"][slot] & 1)
    # the switch never exceeds the MTU payload (1444 B)
    lane = lane or int(rng.choice([v for v in (1, 2, 4) if v * ne <= 1444]))
    hi = {1: 127, 2: 3000, 4: 1 << 20}[lane]
    e = int(rng.integers(-40, 60))
    hdr = HDR.pack(MAGIC, VERSION, int(MsgType.RESULT), job, 0, slot, sset, flags,
                   int(Codec.THC), 3, e, ne, 0, off, 0.0)
    vals = rng.integers(-hi, hi + 1, ne).astype({1: "<i1", 2: "<i2", 4: "<i4"}[lane])
    return hdr + (b"" if flags else vals.tobytes())


@pytest.mark.parametrize("count, W, E, blk", [(5000, 4, 1024, 256), (700, 8, 512, 256),
                                              (3, 2, 1024, 4)])
def test_thc_kernel_matches_twin(count, W, E, blk):
    """THC worker loop: packets (exponent chain, per-packet rotation, int8 stochastic
    rounding) and RESULT bursts in int8/int16/int32 lanes decoded per packet, with junk and
    seeded drops: kernel == twin; the decode equals descale + whole-vector inverse transform."""
    from testbed.kernels.compressors.thc import rht_inverse

    rng = np.random.default_rng(count)
    x = (rng.standard_normal(count) * 2).astype(np.float32)
    if count > E:
        x[:E] = 0.0  # an all-zero chunk (scale 0)
    d = -(-count // blk) * blk
    K = -(-d // E)
    boot, job, n, clip, half = W, 9, 3, 4.0, 8.0
    skey, qkey = np.uint64(777), np.uint64(12345)
    a, b = _thc_state(W, d, K), _thc_state(W, d, K)
    for st in (a, b):
        st["out"] = np.full(count, np.nan, np.float32)
        st["scratch"] = np.zeros(E, np.float32)
    for s in range(min(W, K + boot)):
        la = ik.thc_build_packet(a["pkts"], s, s, x, d, E, K, boot, n, job, 1, 0, a["agreed"],
                                 clip, half, blk, skey, qkey, a["scratch"])
        lb = ik.thc_build_packet_ref(b["pkts"], s, s, x, d, E, K, boot, n, job, 1, 0,
                                     b["agreed"], clip, half, blk, skey, qkey, b["scratch"])
        assert la == lb
        for st in (a, b):
            st["lens"][s], st["cur"][s] = la, s
    assert np.array_equal(a["pkts"], b["pkts"])
    rbuf = np.zeros((16, 2048), np.uint8)
    done, now = 0, 0.0
    while done < K + boot:
        now += 0.001
        live = [s for s in range(W) if a["cur"][s] >= 0]
        msgs = [_thc_result(rng, a, s, job, boot, E, d) for s in rng.permutation(live)]
        msgs.append(_thc_result(rng, a, live[0], job + 1, boot, E, d))
        msgs.append(_thc_result(rng, a, live[0], job, boot, E, d, good=False))
        msgs.append(msgs[0][:HEADER_LEN - 2])
        msgs = msgs[:16]
        rlen = np.zeros(16, np.int64)
        for i, m in enumerate(msgs):
            rbuf[i, :len(m)] = np.frombuffer(m, np.uint8)
            rlen[i] = len(m)
        drop = rng.random(16) < 0.2
        rs = []
        for st, fn in ((a, ik.on_results_thc), (b, ik.on_results_thc_ref)):
            rs.append(fn(rbuf, rlen, len(msgs), drop, st["pkts"], st["lens"], x, d, E,
                         st["qsum"], st["out"], st["agreed"], st["cur"], st["uses"],
                         st["sent_at"], st["retx"], st["deadline"], st["rto"], st["st"], now, K,
                         boot, W, n, job, 1, clip, half, blk, skey, qkey, st["send_list"],
                         st["scratch"]))
        ra, rb = rs
        assert tuple(int(v) for v in ra) == tuple(int(v) for v in rb)
        assert ra[4] == -1 and ra[2] >= 2
        for key in a:
            if key != "scratch":
                assert np.array_equal(a[key], b[key], equal_nan=True), key
        done += ra[0]
    assert (a["cur"] == -1).all()
    ya = np.empty(d, np.float32)
    ik.thc_descale(a["qsum"], a["agreed"], E, clip, half, ya)
    assert np.array_equal(ya, ik.thc_descale_ref(a["qsum"], a["agreed"], E, clip, half))
    whole = np.empty(count, np.float32)
    rht_inverse.serial(ya, blk, skey, count, whole)
    assert np.array_equal(a["out"], whole)
    assert ik.thc_exponent(np.zeros(4, np.float32), 0, 4) == ik.THC_EXP_ZERO
    for v in (1e-30, 0.3, 1.0, 7.5, 3e30):
        z = np.full(16, v, np.float32)
        assert ik.thc_exponent(z, 0, 16) == ik.thc_exponent_ref(z, 0, 16)
        assert 2.0 ** (ik.thc_exponent(z, 0, 16) / ik.NORM_RES) >= 0.999999 * 4 * v


def test_rotate_chunk_matches_whole_vector_transform():
    """Per-packet rotation == thc.rht_forward over the whole vector, bit for bit."""
    from testbed.kernels.compressors.thc import rht_forward

    x = np.random.default_rng(2).standard_normal(3000).astype(np.float32)
    whole = np.empty(3072, np.float32)
    rht_forward.serial(x, 512, np.uint64(99), whole)
    buf = np.empty(1024, np.float32)
    for lo in range(0, 3072, 1024):
        ik.rotate_chunk(x, lo, 1024, 512, np.uint64(99), buf)
        assert np.array_equal(buf, whole[lo:lo + 1024])


def test_thc_quantiser_unbiased_and_bounded():
    """The packet's int8 levels: within -half..half, at most one grid step from y/step, and
    unbiased over many independent streams (mean error << one step)."""
    E, half, clip = 256, 8.0, 4.0
    x = np.random.default_rng(3).standard_normal(E).astype(np.float32)
    y = np.empty(E, np.float32)
    ik.rotate_chunk(x, 0, E, E, np.uint64(5), y)
    pk = np.zeros((1, ik.ROW), np.uint8)
    agreed = np.array([ik.thc_exponent(x, 0, E)], np.int16)
    step = ik.thc_scale(int(agreed[0]), E, clip) / half
    acc = np.zeros(E)
    reps = 400
    for r in range(reps):
        ik.thc_build_packet(pk, 0, 1, x, E, E, 1, 1, 2, 1, 0, 0, agreed, clip, half, E,
                            np.uint64(5), np.uint64(r * 7919 + 1), np.empty(E, np.float32))
        q = pk[0, HEADER_LEN:HEADER_LEN + E].view(np.int8).astype(np.float64)
        assert np.abs(q).max() <= half
        assert np.all(np.abs(q * step - y) < step * (1 + 1e-9))
        acc += q * step
    assert np.abs(acc / reps - y).max() < 0.25 * step  # ~ 0.5 step / sqrt(400) * 5 sigma


def test_thc_kernel_flags_overflow_and_bad_lanes():
    """A RESULT with the OVERFLOW flag or lanes that do not divide its payload -> reported."""
    W, E, d = 2, 1024, 2048
    y = np.ones(d, np.float32)
    for flags, lane, want in ((2, 1, 1), (0, 3, 0)):
        s = _thc_state(W, d, 2)
        for slot in range(W):
            s["lens"][slot] = ik.thc_build_packet(s["pkts"], slot, slot, y, d, E, 2, 0, 2, 1,
                                                  0, 0, s["agreed"], 4.0, 8.0, 1024,
                                                  np.uint64(1), np.uint64(1), np.empty(E, y.dtype))
            s["cur"][slot] = slot
        hdr = HDR.pack(MAGIC, VERSION, int(MsgType.RESULT), 1, 0, 1, 0, flags, int(Codec.THC),
                       2, 0, E, 0, E, 0.0)
        m = hdr + (b"" if flags else bytes(lane * E))
        rbuf = np.zeros((1, 4096), np.uint8)
        rbuf[0, :len(m)] = np.frombuffer(m, np.uint8)
        r = ik.on_results_thc(rbuf, np.array([len(m)], np.int64), 1, np.zeros(1, np.bool_),
                              s["pkts"], s["lens"], y, d, E, s["qsum"], y.copy(), s["agreed"],
                              s["cur"], s["uses"], s["sent_at"], s["retx"], s["deadline"],
                              s["rto"], s["st"], 0.0, 2, 0, W, 2, 1, 0, 4.0, 8.0, 1024,
                              np.uint64(1), np.uint64(1), s["send_list"], np.empty(E, y.dtype))
        assert (r[4], r[5]) == (1, want)
