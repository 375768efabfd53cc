"""Plain-Python twin of :mod:`testbed.collectives.inakernel` (same arguments, same effects).

Written with numpy records and slices, Python ints and the reference transforms of
``testbed.kernels.reference``: the tests run both on the same inputs and compare every array.
"""

from __future__ import annotations

import numpy as np

from testbed.collectives.inakernel import (
    BOOT_OFFSET,
    CC_BETA,
    CC_MAX_MDF,
    CC_OFF,
    CC_TARGET_FACTOR,
    FAST_RETX,
    MODE_NIC,
    MODE_THC,
    NORM_RES,
    REORDER_SLACK,
    THC_EXP_ZERO,
)
from testbed.kernels import wire
from testbed.kernels.reference import fixedpoint as ref_fp
from testbed.kernels.reference.compressors import fwht, hash_u32, rht_forward, uniform
from testbed.kernels.wire import HEADER_LEN, Codec, MsgType

EXP_MIN = ref_fp.EXP_MIN


def thc_exponent(y, lo, hi) -> int:
    """ceil(NORM_RES * log2 ||y[lo:hi]||) summed in float64 in index order; zeros -> zero."""
    s = 0.0
    for v in np.asarray(y[lo:hi], dtype=np.float64).tolist():
        s += v * v
    if s == 0.0:
        return THC_EXP_ZERO
    return int(min(max(np.ceil(NORM_RES * 0.5 * np.log2(s)), -32767.0), 32767.0))


def thc_scale(e, ne, clip) -> float:
    """The agreed clamp value of a chunk of ``ne`` coordinates with agreed exponent ``e``."""
    if e == THC_EXP_ZERO or ne <= 0:
        return 0.0
    return clip * 2.0 ** (float(e) / NORM_RES) / np.sqrt(float(ne))


def thc_quantize(y, lo, scale, half, qkey) -> np.ndarray:
    """int8 levels -half..half, coordinate ``lo + k`` rounded up with probability frac(a)."""
    f = half / scale if scale > 0.0 else 0.0
    a = np.clip(np.asarray(y, dtype=np.float64) * f, -half, half)
    lv = np.floor(a)
    u = uniform(np.arange(lo, lo + a.size), qkey)
    return (lv + (u < a - lv)).astype(np.int8)


def _header(row) -> np.void:
    return row[:HEADER_LEN].view(wire.HEADER_DTYPE)[0]


def build_packet(slots, s, j, p) -> int:
    """Twin of ``inakernel.build_packet``."""
    row = slots.pkts[s]
    seq = int(slots.seq[s])
    if p.mode == MODE_NIC:
        lo = j * p.E
        cnt = min(p.E, p.x.size - lo)
        row[HEADER_LEN:HEADER_LEN + 4 * cnt] = np.frombuffer(p.x[lo:lo + cnt].tobytes(), np.uint8)
        codec, e_next, off, length = Codec.FLOAT32, 0, lo, HEADER_LEN + 4 * cnt
    else:
        thc = p.mode == MODE_THC
        if j < p.K:
            chunk = p.x[j * p.E:min(j * p.E + p.E, p.x.size)]
            e_next = thc_exponent(chunk, 0, chunk.size) if thc else \
                int(ref_fp.chunk_exponents(chunk, max(chunk.size, 1))[0])
        else:
            e_next = THC_EXP_ZERO if thc else EXP_MIN
        codec = Codec.THC if thc else Codec.INT32
        lane = 1 if thc else 4
        if j < p.boot:
            row[HEADER_LEN:HEADER_LEN + lane] = 0
            cnt, off = 1, BOOT_OFFSET
        else:
            c = j - p.boot
            off = c * p.E
            cnt = min(p.E, p.d - off)
            if thc:
                y = rht_forward(p.x, p.blk, p.skey, p.d)[off:off + cnt]
                q = thc_quantize(y, off, thc_scale(int(p.agreed[c]), cnt, p.clip), p.half,
                                 p.qkey)
                row[HEADER_LEN:HEADER_LEN + cnt] = q.view(np.uint8)
            else:
                q = ref_fp.quantize(p.x[off:off + cnt], p.agreed[c:c + 1], p.n, cnt)
                row[HEADER_LEN:HEADER_LEN + 4 * cnt] = q.astype("<i4").view(np.uint8)
        length = HEADER_LEN + lane * cnt
    row[:HEADER_LEN] = np.frombuffer(wire.pack_header(
        msg_type=int(MsgType.DATA), job_id=p.job_id, worker_id=p.member, slot=s, slot_set=seq & 1,
        codec=int(codec), n_workers=p.n, exponent=e_next, elem_count=cnt, chunk_offset=off,
        seq=seq), np.uint8)
    return length


def match_result(rb, ln, slots, p) -> int:
    """Twin of ``inakernel.match_result``."""
    if ln < HEADER_LEN:
        return -1
    h = _header(rb)
    s = int(h["slot"])
    if (h["magic"] != wire.MAGIC or h["msg_type"] != MsgType.RESULT or h["job_id"] != p.job_id
            or s >= slots.cur.size):
        return -1
    j = int(slots.cur[s])
    if j < 0 or int(h["seq"]) != int(slots.seq[s]):
        return -1
    want = (j - p.boot) * p.E if j >= p.boot else BOOT_OFFSET
    return s if int(h["chunk_offset"]) == want else -1


def apply_result(rb, ln, s, slots, p) -> int:
    """Twin of ``inakernel.apply_result``."""
    h = _header(rb)
    j = int(slots.cur[s])
    ne = int(h["elem_count"])
    if p.mode == MODE_THC and int(h["flags"]) & wire.Flags.OVERFLOW:
        return 2
    want = 1 if j < p.boot else min(p.E, p.d - (j - p.boot) * p.E)
    pl = int(ln) - HEADER_LEN
    lane = pl // ne if ne else 0
    if p.mode == MODE_THC:
        ok = h["codec"] == Codec.THC and lane in (1, 2, 4)
    else:
        ok = h["codec"] == (Codec.FLOAT32 if p.mode == MODE_NIC else Codec.INT32) and lane == 4
    if ne != want or not ok or lane * ne != pl:
        return 1
    if j < p.K and p.mode != MODE_NIC:
        p.agreed[j] = h["exponent"]
    if j < p.boot:
        return 0
    c = j - p.boot
    lo = c * p.E
    data = rb[HEADER_LEN:HEADER_LEN + pl].tobytes()
    if p.mode == MODE_NIC:
        p.out[lo:lo + ne] = np.frombuffer(data, "<f4")
    elif p.mode != MODE_THC:
        p.qsum[lo:lo + ne] = np.frombuffer(data, "<i4")
    else:
        p.qsum[lo:lo + ne] = np.frombuffer(data, {1: "<i1", 2: "<i2", 4: "<i4"}[lane])
        sc = thc_scale(int(p.agreed[c]), ne, p.clip) / p.half
        z = (fwht((p.qsum[lo:lo + ne] * sc).astype(np.float32).reshape(-1, p.blk))
             * np.float32(1.0 / np.sqrt(p.blk))).ravel()
        neg = (hash_u32(np.arange(lo, lo + ne), p.skey) & np.uint64(1)).astype(bool)
        hi = min(lo + ne, p.out.size)
        p.out[lo:hi] = np.where(neg, -z, z)[:hi - lo]
    return 0


def dequantize_int32(p) -> None:
    """Twin of the client's final step for MODE_INT32: ``out`` from ``qsum`` per chunk."""
    for k in range(p.K):
        lo, hi = k * p.E, min(k * p.E + p.E, p.x.size)
        p.out[lo:hi] = ref_fp.dequantize(p.qsum[lo:hi], p.agreed[k:k + 1], p.n, hi - lo)


def _send(slots, s, st, now, msg_type) -> None:
    slots.pkts[s][wire.FIELD_OFFSETS["msg_type"]] = int(msg_type)
    slots.sent_at[s] = now
    slots.order[s] = st["sends"]
    st["sends"] += 1
    slots.deadline[s] = now + slots.rto[s]


def _cc_sample(st, rtt: float, order: int, W: int) -> None:
    """Twin of ``inakernel.cc_sample``."""
    if st["base_rtt"] == 0.0 or rtt < st["base_rtt"]:
        st["base_rtt"] = rtt
    target = float(st["base_rtt"]) * CC_TARGET_FACTOR + float(st["margin"])
    cwnd = float(st["cwnd"])
    if rtt <= target:
        st["cwnd"] = min(cwnd + 1.0 / cwnd, float(W))
    elif order >= int(st["dec_order"]):
        _decrease(st, max(1.0 - CC_BETA * (rtt - target) / rtt, 1.0 - CC_MAX_MDF))


def _decrease(st, factor: float) -> None:
    st["cwnd"] = max(1.0, float(st["cwnd"]) * factor)
    st["dec_order"] = st["sends"]
    st["cwnd_min"] = min(float(st["cwnd_min"]), float(st["cwnd"]))


def _pump(slots, st, now, p, send_list, nsend) -> int:
    """Twin of ``inakernel.pump``: packets in order while fewer than cwnd are outstanding."""
    W = slots.cur.size
    while int(st["nxt"]) < p.K + p.boot and int(st["inflight"]) < int(st["cwnd"]):
        j = int(st["nxt"])
        s = j % W
        if slots.cur[s] >= 0:  # its previous packet is still outstanding
            break
        slots.cur[s] = j
        slots.lens[s] = build_packet(slots, s, j, p)
        _send(slots, s, st, now, MsgType.DATA)
        send_list[nsend] = s
        nsend += 1
        st["nxt"] += 1
        st["inflight"] += 1
    return nsend


def on_results(rbuf, rlen, nrecv, drop, slots, loop, p, now, send_list):
    """Twin of ``inakernel.on_results``."""
    st = loop[0]
    W = slots.cur.size
    done = nsend = ignored = lost = 0
    for i in range(nrecv):
        s = match_result(rbuf[i], rlen[i], slots, p)
        if s < 0:
            ignored += 1
            continue
        if drop[i]:
            lost += 1
            continue
        code = apply_result(rbuf[i], rlen[i], s, slots, p)
        if code:
            return done, nsend, ignored, lost, s, code
        done += 1
        st["progress"] = now
        clean = not slots.retx[s]
        if clean:
            sample = now - slots.sent_at[s]
            slots.rtt[s] = sample
            if st["srtt"] == 0.0:
                st["srtt"], st["rttvar"] = sample, sample / 2
            else:
                st["rttvar"] = 0.75 * st["rttvar"] + 0.25 * abs(st["srtt"] - sample)
                st["srtt"] = 0.875 * st["srtt"] + 0.125 * sample
            st["rto"] = min(max(st["t0"], st["srtt"] + 4 * st["rttvar"]), st["tmax"])
        slots.retx[s] = False
        rto = min(max(st["rto"], 2.0 * slots.rtt[s]), st["tmax"])
        slots.rto[s] = rto if clean else max(rto, slots.rto[s])  # Karn: keep the backoff
        if clean and int(slots.order[s]) > int(st["acked"]):
            st["acked"] = int(slots.order[s])
            st["rack_rtt"] = slots.rtt[s]
        slots.seq[s] = (int(slots.seq[s]) + 1) % (1 << 32)
        if st["cc"] != CC_OFF:  # the slot waits for its turn in _pump
            if clean:
                _cc_sample(st, float(slots.rtt[s]), int(slots.order[s]), W)
            st["inflight"] -= 1
            slots.cur[s] = -1
            slots.deadline[s] = np.inf
            continue
        nj = int(slots.cur[s]) + W
        if nj >= p.K + p.boot:
            slots.cur[s] = -1
            slots.deadline[s] = np.inf
            continue
        slots.cur[s] = nj
        slots.lens[s] = build_packet(slots, s, nj, p)
        _send(slots, s, st, now, MsgType.DATA)
        send_list[nsend] = s
        nsend += 1
    if st["cc"] != CC_OFF:
        nsend = _pump(slots, st, now, p, send_list, nsend)
    for s in range(W):
        ref = max(st["rack_rtt"], slots.rtt[s])
        ref = ref if ref > 0.0 else st["srtt"]
        if slots.cur[s] >= 0 and slots.order[s] + FAST_RETX <= st["acked"] and \
                now - slots.sent_at[s] > REORDER_SLACK * ref:
            slots.retx[s] = True
            _send(slots, s, st, now, MsgType.RETRANSMIT)
            send_list[nsend] = s
            nsend += 1
    return done, nsend, ignored, lost, -1, 0


def expire(slots, loop, now, send_list) -> int:
    """Twin of ``inakernel.expire``."""
    st = loop[0]
    due = [s for s in range(slots.cur.size) if slots.cur[s] >= 0 and slots.deadline[s] <= now]
    for k, s in enumerate(due):
        if st["cc"] != CC_OFF and int(slots.order[s]) >= int(st["dec_order"]):
            _decrease(st, 1.0 - CC_MAX_MDF)
        slots.rto[s] = min(slots.rto[s] * 2, st["tmax"])
        slots.retx[s] = True
        _send(slots, s, st, now, MsgType.RETRANSMIT)
        send_list[k] = s
    return len(due)


def start(slots, loop, p, now, send_list) -> int:
    """Twin of ``inakernel.start``."""
    st = loop[0]
    W = slots.cur.size
    k = min(W, p.K + p.boot)
    if st["cc"] != CC_OFF:
        cwnd = float(st["cwnd"])
        st["cwnd"] = float(W) if cwnd <= 0.0 else min(max(cwnd, 1.0), float(W))
        st["cwnd_min"] = st["cwnd"]
        st["dec_order"] = st["nxt"] = st["inflight"] = 0
        slots.cur[:k] = -1
        slots.deadline[:k] = np.inf
        slots.retx[:k] = False
        slots.rto[:k] = st["rto"]
        return _pump(slots, st, now, p, send_list, 0)
    for s in range(k):
        slots.cur[s] = s
        slots.retx[s] = False
        slots.rto[s] = st["rto"]
        slots.lens[s] = build_packet(slots, s, s, p)
        _send(slots, s, st, now, MsgType.DATA)
        send_list[s] = s
    return k


def gso_batches(send_list, k, lens, iov_addr, hdr, ctrl, max_bytes, max_segs, overhead) -> int:
    """Split ``send_list[:k]`` into runs: a run ends before a longer packet, after a shorter
    one, or when it holds the most packets the caps allow for its first packet's length."""
    sizes = [int(lens[s]) for s in send_list[:k]]
    runs: list[tuple[int, int]] = []  # (first index, count)
    for i, ln in enumerate(sizes):
        if runs:
            a, c = runs[-1]
            first, last = sizes[a], sizes[a + c - 1]
            cap = max(1, min(max_segs, max_bytes // (first + overhead)))
            if c < cap and last == first and ln <= first:
                runs[-1] = (a, c + 1)
                continue
        runs.append((i, 1))
    for g, (a, c) in enumerate(runs):
        hdr[g, 2] = int(iov_addr) + 16 * a
        hdr[g, 3] = c
        ctrl[g, 2] = sizes[a]
    return len(runs)
