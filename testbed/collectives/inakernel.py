"""Batched hot loop of the INA worker: one ``@njit`` call per received burst.

:func:`on_results` walks a burst of RESULT datagrams (from ``recvmmsg``), applies each to the
worker's per-slot state (see ``ina.py`` for the protocol), builds the next packet of every
completed slot in place and lists the slots to send (for ``sendmmsg``). Python only loops
over bursts. :func:`on_results_ref` is its plain-Python twin (same arguments, same effects);
tests run both on the same inputs and compare every output array.

Packet rows: ``pkts[W, ROW]`` bytes (testbed header + up to 256 elements); ``pkts_i32`` /
``pkts_f32`` are int32 / float32 views of the same memory (the payload starts at element 7 =
byte 28). Received datagrams: ``rbuf[B, RB]`` bytes with views ``rbuf_i32`` / ``rbuf_f32``.

``st`` (float64[4]) = srtt, rttvar, base timeout, last progress time. Returns
``(done, nsend, ignored, lost, bad_slot)``; ``bad_slot >= 0`` flags a RESULT whose chunk offset,
element count or codec does not match the slot's packet (protocol violation, the caller
raises; nothing is written out of bounds).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from testbed.kernels import fixedpoint as fp
from testbed.kernels.compressors.thc import fwht_inplace
from testbed.kernels.rng import hash_u32, uniform
from testbed.kernels.wire import FIELD_OFFSETS, HEADER_LEN, MAGIC, VERSION, Codec, MsgType

ELEMS = 256
ROW = HEADER_LEN + 4 * ELEMS
P0 = HEADER_LEN // 4  # first payload element in an int32/float32 view of a row
T0 = 0.010
#: chunk_offset of the exponent bootstrap packets: never a data offset, so a late duplicate
#: of a bootstrap result is never taken for data (or the other way round)
BOOT_OFFSET = 0xFFFFFFFF
T_MAX = 0.320
_RESULT = int(MsgType.RESULT)
_DATA = int(MsgType.DATA)
_INT32 = int(Codec.INT32)
_FLOAT32 = int(Codec.FLOAT32)
_EXP_MIN = fp.EXP_MIN
_FO = FIELD_OFFSETS
_O_TYPE, _O_JOB, _O_WORKER, _O_SLOT = _FO["msg_type"], _FO["job_id"], _FO["worker_id"], _FO["slot"]
_O_SET, _O_FLAGS, _O_CODEC, _O_NW = _FO["slot_set"], _FO["flags"], _FO["codec"], _FO["n_workers"]
_O_EXP, _O_ELEMS, _O_HEAD, _O_CHUNK = _FO["exponent"], _FO["elem_count"], _FO["head_bytes"], \
    _FO["chunk_offset"]
_O_SCALE = _FO["scale"]


@njit(cache=True)
def _u16(b, i, o):
    return np.int64(b[i, o]) | (np.int64(b[i, o + 1]) << 8)


@njit(cache=True)
def _put16(b, i, o, v):
    b[i, o] = np.uint8(v & 0xFF)
    b[i, o + 1] = np.uint8((v >> 8) & 0xFF)


@njit(cache=True)
def _write_data_header(pkts, slot, job_id, rank, sset, codec, n, e_next, cnt, off):
    """Fill the testbed header of the DATA packet in row ``slot`` (shared by every codec)."""
    _put16(pkts, slot, 0, MAGIC)
    pkts[slot, 2] = VERSION
    pkts[slot, _O_TYPE] = _DATA
    _put16(pkts, slot, _O_JOB, job_id)
    _put16(pkts, slot, _O_WORKER, rank)
    _put16(pkts, slot, _O_SLOT, slot)
    pkts[slot, _O_SET] = sset
    pkts[slot, _O_FLAGS] = 0
    pkts[slot, _O_CODEC] = codec
    pkts[slot, _O_NW] = n
    _put16(pkts, slot, _O_EXP, e_next & 0xFFFF)
    _put16(pkts, slot, _O_ELEMS, cnt)
    _put16(pkts, slot, _O_HEAD, 0)
    for k in range(4):
        pkts[slot, _O_CHUNK + k] = np.uint8((off >> (8 * k)) & 0xFF)
        pkts[slot, _O_SCALE + k] = 0


@njit(cache=True)
def _chunk_offset(rbuf, i):
    """``chunk_offset`` of received datagram ``i`` (little-endian u32)."""
    off = np.int64(0)
    for k in range(4):
        off |= np.int64(rbuf[i, _O_CHUNK + k]) << (8 * k)
    return off


@njit(cache=True)
def _rtt_sample(st, sample):
    """Jacobson/Karels: update srtt ``st[0]``, rttvar ``st[1]`` and the timeout ``st[2]``."""
    if st[0] == 0.0:
        st[0] = sample
        st[1] = sample / 2
    else:
        st[1] = 0.75 * st[1] + 0.25 * abs(st[0] - sample)
        st[0] = 0.875 * st[0] + 0.125 * sample
    st[2] = min(max(T0, st[0] + 4 * st[1]), T_MAX)


@njit(cache=True)
def build_packet(pkts, pkts_i32, pkts_f32, slot, j, x, K, boot, n, job_id, rank, sset,
                 agreed, nic):
    """Write packet ``j`` (bootstrap, or data chunk j-boot) into row ``slot``; return length."""
    if nic:
        lo = j * ELEMS
        cnt = min(ELEMS, x.size - lo)
        for k in range(cnt):
            pkts_f32[slot, P0 + k] = x[lo + k]
        e_next = 0
        codec = _FLOAT32
        off = lo
    else:
        if j < K:
            lo = j * ELEMS
            e_next = fp.block_exponent(x[lo:min(lo + ELEMS, x.size)])  # local exponent of j
        else:
            e_next = _EXP_MIN
        if j >= boot:
            lo = (j - boot) * ELEMS
            cnt = min(ELEMS, x.size - lo)
            fp.quantize_into(x[lo:lo + cnt], fp.scale_for(np.int64(agreed[j - boot]), n),
                             pkts_i32[slot, P0:P0 + cnt])
            off = lo
        else:
            cnt = 1
            pkts_i32[slot, P0] = 0
            off = BOOT_OFFSET
        codec = _INT32
    _write_data_header(pkts, slot, job_id, rank, sset, codec, n, e_next, cnt, off)
    return HEADER_LEN + 4 * cnt


@njit(cache=True)
def on_results(rbuf, rbuf_i32, rbuf_f32, rlen, nrecv, drop, pkts, pkts_i32, pkts_f32, lens,
               x, qsum, out, agreed, cur, uses, sent_at, retx, deadline, rto, st, now, K,
               boot, W, n, job_id, rank, nic, send_list):
    """Apply a burst of received datagrams; see the module docstring."""
    total = K + boot
    done = 0
    nsend = 0
    ignored = 0
    lost = 0
    for i in range(nrecv):
        ln = rlen[i]
        if ln < HEADER_LEN:
            ignored += 1
            continue
        slot = _u16(rbuf, i, _O_SLOT)
        ne = _u16(rbuf, i, _O_ELEMS)
        if (_u16(rbuf, i, 0) != MAGIC or rbuf[i, _O_TYPE] != _RESULT
                or _u16(rbuf, i, _O_JOB) != job_id or slot >= W or cur[slot] < 0
                or rbuf[i, _O_SET] != (uses[slot] & 1) or ln < HEADER_LEN + 4 * ne):
            ignored += 1  # not ours, or a duplicate answer to a retransmission
            continue
        if drop[i]:
            lost += 1
            continue
        j = cur[slot]
        off = _chunk_offset(rbuf, i)
        lo = (j - boot) * ELEMS if j >= boot else BOOT_OFFSET
        if off != lo:
            ignored += 1  # a late duplicate of an older packet on this slot (same set bit)
            continue
        if j < K and not nic:
            e = _u16(rbuf, i, _O_EXP)
            agreed[j] = e - 65536 if e >= 32768 else e
        if j >= boot:
            if ne != min(ELEMS, x.size - lo) or (nic and rbuf[i, _O_CODEC] != _FLOAT32):
                return done, nsend, ignored, lost, slot
            if nic:
                for k in range(ne):
                    out[lo + k] = rbuf_f32[i, P0 + k]
            else:
                for k in range(ne):
                    qsum[lo + k] = rbuf_i32[i, P0 + k]
        done += 1
        st[3] = now
        uses[slot] += 1
        if not retx[slot]:  # Karn: only unambiguous samples
            _rtt_sample(st, now - sent_at[slot])
        rto[slot] = st[2]
        retx[slot] = False
        nj = j + W
        if nj < total:
            lens[slot] = build_packet(pkts, pkts_i32, pkts_f32, slot, nj, x, K, boot, n,
                                      job_id, rank, uses[slot] & 1, agreed, nic)
            cur[slot] = nj
            sent_at[slot] = now
            deadline[slot] = now + st[2]
            send_list[nsend] = slot
            nsend += 1
        else:
            cur[slot] = -1
            deadline[slot] = np.inf
    return done, nsend, ignored, lost, -1


# ------------------------------------------------------------------------------ numpy twins


def build_packet_ref(pkts, pkts_i32, pkts_f32, slot, j, x, K, boot, n, job_id, rank, sset,
                     agreed, nic):
    """Plain numpy/struct twin of :func:`build_packet`."""
    import struct

    if nic:
        lo = j * ELEMS
        cnt = min(ELEMS, x.size - lo)
        pkts_f32[slot, P0:P0 + cnt] = x[lo:lo + cnt]
        e_next, codec, off = 0, _FLOAT32, lo
    else:
        if j < K:
            chunk = x[j * ELEMS:(j + 1) * ELEMS]
            m = float(np.max(np.abs(chunk))) if chunk.size else 0.0
            if m == 0.0:
                e_next = _EXP_MIN
            else:
                mant, ex = np.frexp(m)
                e_next = max(int(ex) - 1 if mant == 0.5 else int(ex), _EXP_MIN)
        else:
            e_next = _EXP_MIN
        if j >= boot:
            lo = (j - boot) * ELEMS
            cnt = min(ELEMS, x.size - lo)
            f = np.ldexp(float(fp.INT32_MAX // n), -int(agreed[j - boot]))
            pkts_i32[slot, P0:P0 + cnt] = np.rint(x[lo:lo + cnt].astype(np.float64) * f
                                                  ).astype(np.int32)
            off = lo
        else:
            cnt = 1
            pkts_i32[slot, P0] = 0
            off = BOOT_OFFSET
        codec = _INT32
    hdr = struct.pack("<HBBHHHBBBBhHHIf", MAGIC, VERSION, _DATA, job_id, rank, slot, sset, 0,
                      codec, n, e_next, cnt, 0, off, 0.0)
    pkts[slot, :HEADER_LEN] = np.frombuffer(hdr, dtype=np.uint8)
    return HEADER_LEN + 4 * cnt


def on_results_ref(rbuf, rbuf_i32, rbuf_f32, rlen, nrecv, drop, pkts, pkts_i32, pkts_f32,
                   lens, x, qsum, out, agreed, cur, uses, sent_at, retx, deadline, rto, st,
                   now, K, boot, W, n, job_id, rank, nic, send_list):
    """Plain-Python twin of :func:`on_results` (struct parsing, numpy slices)."""
    import struct

    hdr = struct.Struct("<HBBHHHBBBBhHHIf")
    total = K + boot
    done = nsend = ignored = lost = 0
    for i in range(nrecv):
        ln = int(rlen[i])
        if ln < HEADER_LEN:
            ignored += 1
            continue
        (magic, _v, mt, job, _w, slot, sset, _f, codec, _n, e, ne, _h, off,
         _s) = hdr.unpack_from(rbuf[i].tobytes(), 0)
        if (magic != MAGIC or mt != _RESULT or job != job_id or slot >= W or cur[slot] < 0
                or sset != (uses[slot] & 1) or ln < HEADER_LEN + 4 * ne):
            ignored += 1
            continue
        if drop[i]:
            lost += 1
            continue
        j = int(cur[slot])
        lo = (j - boot) * ELEMS if j >= boot else BOOT_OFFSET
        if off != lo:
            ignored += 1
            continue
        if j < K and not nic:
            agreed[j] = e
        if j >= boot:
            if ne != min(ELEMS, x.size - lo) or (nic and codec != _FLOAT32):
                return done, nsend, ignored, lost, slot
            if nic:
                out[lo:lo + ne] = rbuf_f32[i, P0:P0 + ne]
            else:
                qsum[lo:lo + ne] = rbuf_i32[i, P0:P0 + ne]
        done += 1
        st[3] = now
        uses[slot] += 1
        if not retx[slot]:
            sample = now - sent_at[slot]
            if st[0] == 0.0:
                st[0], st[1] = sample, sample / 2
            else:
                st[1] = 0.75 * st[1] + 0.25 * abs(st[0] - sample)
                st[0] = 0.875 * st[0] + 0.125 * sample
            st[2] = min(max(T0, st[0] + 4 * st[1]), T_MAX)
        rto[slot] = st[2]
        retx[slot] = False
        nj = j + W
        if nj < total:
            lens[slot] = build_packet_ref(pkts, pkts_i32, pkts_f32, slot, nj, x, K, boot, n,
                                          job_id, rank, int(uses[slot] & 1), agreed, nic)
            cur[slot] = nj
            sent_at[slot] = now
            deadline[slot] = now + st[2]
            send_list[nsend] = slot
            nsend += 1
        else:
            cur[slot] = -1
            deadline[slot] = np.inf
    return done, nsend, ignored, lost, -1


# ------------------------------------------------------------------ THC (INA + compression)
#
# algo="ina", compressor="thc" (see ina.py): per packet of E coordinates (whole rotation blocks),
# the ``exponent`` field carries ceil(NORM_RES * log2 ||chunk||) of the packet's chunk (the norm
# is rotation invariant, so it is taken before rotating) one slot-round ahead (the switch max-combines it, exactly like SwitchML's exponent),
# and the payload is that chunk stochastically rounded to int8 levels -half..half on the grid
# of the agreed scale M = clip * 2**(e/NORM_RES) / sqrt(ne), after rotating the chunk with the
# blockwise randomized Hadamard transform (shared sign stream, global element index: the same
# numbers as thc.rht_forward over the whole vector). The switch adds the int8 lanes in int32
# registers and answers in the narrowest lane that holds the sums (int8/int16/int32, told by
# payload bytes / elem_count) or with the OVERFLOW flag; each RESULT is de-scaled and
# inverse-rotated into ``out`` as it arrives. Rotating and decoding per packet keeps the
# transforms off the critical path (they overlap the network) and workers start in step.

#: int8 lanes per THC packet: the bytes of 256 int32, so a quarter of the packets of plain INA.
THC_ELEMS = 1024
#: exponent units per octave: the agreed norm bound 2**(e/8) is at most 9 % above the norm
NORM_RES = 8
#: exponent of an all-zero chunk (scale 0: everything quantises to 0)
THC_EXP_ZERO = -32768
_THC = int(Codec.THC)
_OVERFLOW = 2  # wire.Flags.OVERFLOW


@njit(cache=True)
def thc_exponent(y, lo, hi):
    """ceil(NORM_RES * log2(||y[lo:hi]||_2)) (float64 accumulation), THC_EXP_ZERO for zeros."""
    s = 0.0
    for k in range(lo, hi):
        v = np.float64(y[k])
        s += v * v
    if s == 0.0:
        return THC_EXP_ZERO
    e = np.ceil(NORM_RES * 0.5 * np.log2(s))
    return np.int64(min(max(e, -32767.0), 32767.0))


@njit(cache=True)
def thc_scale(e, ne, clip):
    """The agreed clamp value M of a chunk of ``ne`` coordinates with agreed exponent ``e``."""
    if e == THC_EXP_ZERO or ne <= 0:
        return 0.0
    return clip * 2.0 ** (np.float64(e) / NORM_RES) / np.sqrt(np.float64(ne))


@njit(cache=True)
def rotate_chunk(x, lo, cnt, blk, key, buf):
    """buf[0:cnt] = the rotation (H D / sqrt(blk), blockwise) of x[lo:lo+cnt] zero-padded;
    signs by global index, so bit-identical to ``thc.rht_forward`` over the whole vector."""
    inv = np.float32(1.0 / np.sqrt(blk))
    for b in range(cnt // blk):
        seg = buf[b * blk:(b + 1) * blk]
        base = lo + b * blk
        for jj in range(blk):
            k = base + jj
            v = x[k] if k < x.size else np.float32(0.0)
            seg[jj] = -v if hash_u32(k, key) & np.uint64(1) else v
        fwht_inplace(seg)
        for jj in range(blk):
            seg[jj] *= inv


@njit(cache=True)
def unrotate_chunk(buf, lo, cnt, blk, key, out):
    """out[lo:lo+cnt] (clipped to out.size) = inverse rotation of buf[0:cnt] (buf is
    overwritten); bit-identical to ``thc.rht_inverse`` over the whole vector."""
    inv = np.float32(1.0 / np.sqrt(blk))
    for b in range(cnt // blk):
        seg = buf[b * blk:(b + 1) * blk]
        fwht_inplace(seg)
        base = lo + b * blk
        for jj in range(blk):
            k = base + jj
            if k < out.size:
                v = seg[jj] * inv
                out[k] = -v if hash_u32(k, key) & np.uint64(1) else v


@njit(cache=True)
def thc_build_packet(pkts, slot, j, x, d, E, K, boot, n, job_id, rank, sset, agreed, clip,
                     half, blk, skey, qkey, scratch):
    """Write THC packet ``j`` (bootstrap, or chunk j-boot rotated into ``scratch``) into row
    ``slot``; return its length. Coordinate ``i`` rounds up with probability frac(a) using
    ``uniform(i, qkey)`` (counter-based: the twin draws the same numbers)."""
    if j < K:
        e_next = thc_exponent(x, j * E, min(j * E + E, x.size))
    else:
        e_next = THC_EXP_ZERO
    if j >= boot:
        lo = (j - boot) * E
        cnt = min(E, d - lo)
        rotate_chunk(x, lo, cnt, blk, skey, scratch)
        sc = thc_scale(np.int64(agreed[j - boot]), cnt, clip)
        f = half / sc if sc > 0.0 else 0.0
        lim = np.float64(half)
        for k in range(cnt):
            a = np.float64(scratch[k]) * f
            if a > lim:
                a = lim
            elif a < -lim:
                a = -lim
            lv = np.floor(a)
            if uniform(lo + k, qkey) < a - lv:
                lv += 1.0
            pkts[slot, HEADER_LEN + k] = np.uint8(np.int64(lv) & 0xFF)
        off = lo
    else:
        cnt = 1
        pkts[slot, HEADER_LEN] = 0
        off = BOOT_OFFSET
    _write_data_header(pkts, slot, job_id, rank, sset, _THC, n, e_next, cnt, off)
    return HEADER_LEN + cnt


@njit(cache=True)
def on_results_thc(rbuf, rlen, nrecv, drop, pkts, lens, x, d, E, qsum, out, agreed, cur, uses,
                   sent_at, retx, deadline, rto, st, now, K, boot, W, n, job_id, rank, clip,
                   half, blk, skey, qkey, send_list, scratch):
    """THC twin of :func:`on_results`: apply a burst of RESULTs (int8/int16/int32 lanes into
    ``qsum``, decoded into ``out``), build the next packets. Returns ``(done, nsend, ignored,
    lost, bad_slot, overflow)``; ``overflow`` = 1 when ``bad_slot``'s RESULT carried the
    OVERFLOW flag."""
    total = K + boot
    done = 0
    nsend = 0
    ignored = 0
    lost = 0
    for i in range(nrecv):
        ln = rlen[i]
        if ln < HEADER_LEN:
            ignored += 1
            continue
        slot = _u16(rbuf, i, _O_SLOT)
        ne = _u16(rbuf, i, _O_ELEMS)
        if (_u16(rbuf, i, 0) != MAGIC or rbuf[i, _O_TYPE] != _RESULT
                or _u16(rbuf, i, _O_JOB) != job_id or slot >= W or cur[slot] < 0
                or rbuf[i, _O_SET] != (uses[slot] & 1)):
            ignored += 1  # not ours, or a duplicate answer to a retransmission
            continue
        if drop[i]:
            lost += 1
            continue
        j = cur[slot]
        off = _chunk_offset(rbuf, i)
        lo = (j - boot) * E if j >= boot else BOOT_OFFSET
        if off != lo:
            ignored += 1  # a late duplicate of an older packet on this slot (same set bit)
            continue
        if rbuf[i, _O_FLAGS] & _OVERFLOW:
            return done, nsend, ignored, lost, slot, 1
        want = 1 if j < boot else min(E, d - lo)
        pl = ln - HEADER_LEN
        lane = pl // ne if ne > 0 else 0
        if (ne != want or rbuf[i, _O_CODEC] != _THC or lane * ne != pl
                or (lane != 1 and lane != 2 and lane != 4)):
            return done, nsend, ignored, lost, slot, 0
        if j < K:
            e = _u16(rbuf, i, _O_EXP)
            agreed[j] = e - 65536 if e >= 32768 else e
        if j >= boot:
            p = HEADER_LEN
            for k in range(ne):
                v = np.int64(rbuf[i, p])
                for b in range(1, lane):
                    v |= np.int64(rbuf[i, p + b]) << (8 * b)
                top = np.int64(1) << (8 * lane - 1)
                if v >= top:
                    v -= top << 1
                qsum[lo + k] = v
                p += lane
            s = thc_scale(np.int64(agreed[j - boot]), ne, clip) / half
            for k in range(ne):
                scratch[k] = np.float32(qsum[lo + k] * s)
            unrotate_chunk(scratch, lo, ne, blk, skey, out)
        done += 1
        st[3] = now
        uses[slot] += 1
        if not retx[slot]:  # Karn: only unambiguous samples
            _rtt_sample(st, now - sent_at[slot])
        rto[slot] = st[2]
        retx[slot] = False
        nj = j + W
        if nj < total:
            lens[slot] = thc_build_packet(pkts, slot, nj, x, d, E, K, boot, n, job_id, rank,
                                          uses[slot] & 1, agreed, clip, half, blk, skey, qkey,
                                          scratch)
            cur[slot] = nj
            sent_at[slot] = now
            deadline[slot] = now + st[2]
            send_list[nsend] = slot
            nsend += 1
        else:
            cur[slot] = -1
            deadline[slot] = np.inf
    return done, nsend, ignored, lost, -1, 0


@njit(cache=True)
def thc_descale(qsum, agreed, E, clip, half, ysum):
    """ysum = qsum * M_k / half per chunk k (M_k from the agreed exponent): the summed rotated
    coordinates, ready for the inverse transform."""
    d = qsum.size
    K = (d + E - 1) // E
    for c in range(K):
        lo = c * E
        hi = min(lo + E, d)
        s = thc_scale(np.int64(agreed[c]), hi - lo, clip) / half
        for k in range(lo, hi):
            ysum[k] = np.float32(qsum[k] * s)


# --------------------------------------------------------------------- THC numpy twins


def thc_exponent_ref(y, lo, hi):
    """numpy twin of :func:`thc_exponent`."""
    s = 0.0
    for v in np.asarray(y[lo:hi], dtype=np.float64).tolist():  # same order as the kernel
        s += v * v
    if s == 0.0:
        return THC_EXP_ZERO
    return int(min(max(np.ceil(NORM_RES * 0.5 * np.log2(s)), -32767.0), 32767.0))


def thc_scale_ref(e, ne, clip):
    """numpy twin of :func:`thc_scale`."""
    if e == THC_EXP_ZERO or ne <= 0:
        return 0.0
    return clip * 2.0 ** (float(e) / NORM_RES) / np.sqrt(float(ne))


def thc_quantize_ref(y, lo, scale, half, qkey):
    """numpy twin of the quantiser inside :func:`thc_build_packet` (int8 levels)."""
    from testbed.kernels.reference.rng import uniform

    f = half / scale if scale > 0.0 else 0.0
    a = np.clip(np.asarray(y, dtype=np.float64) * f, -half, half)
    lv = np.floor(a)
    u = uniform(np.arange(lo, lo + a.size), qkey)
    return (lv + (u < a - lv)).astype(np.int8)


def thc_build_packet_ref(pkts, slot, j, x, d, E, K, boot, n, job_id, rank, sset, agreed, clip,
                         half, blk, skey, qkey, scratch):
    """Plain numpy/struct twin of :func:`thc_build_packet` (rotates the whole vector with the
    reference transform and slices it; ``scratch`` is unused)."""
    import struct

    from testbed.kernels.reference.compressors import rht_forward

    e_next = thc_exponent_ref(x, j * E, min(j * E + E, x.size)) if j < K else THC_EXP_ZERO
    if j >= boot:
        lo = (j - boot) * E
        cnt = min(E, d - lo)
        y = rht_forward(x, blk, skey, d)
        sc = thc_scale_ref(int(agreed[j - boot]), cnt, clip)
        q = thc_quantize_ref(y[lo:lo + cnt], lo, sc, half, qkey)
        pkts[slot, HEADER_LEN:HEADER_LEN + cnt] = q.view(np.uint8)
        off = lo
    else:
        cnt, off = 1, BOOT_OFFSET
        pkts[slot, HEADER_LEN] = 0
    hdr = struct.pack("<HBBHHHBBBBhHHIf", MAGIC, VERSION, _DATA, job_id, rank, slot, sset, 0,
                      _THC, n, e_next, cnt, 0, off, 0.0)
    pkts[slot, :HEADER_LEN] = np.frombuffer(hdr, dtype=np.uint8)
    return HEADER_LEN + cnt


def on_results_thc_ref(rbuf, rlen, nrecv, drop, pkts, lens, x, d, E, qsum, out, agreed, cur,
                       uses, sent_at, retx, deadline, rto, st, now, K, boot, W, n, job_id, rank,
                       clip, half, blk, skey, qkey, send_list, scratch):
    """Plain-Python twin of :func:`on_results_thc` (struct parsing, numpy slices, the
    reference transform)."""
    import struct

    from testbed.kernels.reference.compressors import fwht
    from testbed.kernels.reference.rng import hash_u32

    hdr = struct.Struct("<HBBHHHBBBBhHHIf")
    total = K + boot
    done = nsend = ignored = lost = 0
    for i in range(nrecv):
        ln = int(rlen[i])
        if ln < HEADER_LEN:
            ignored += 1
            continue
        (magic, _v, mt, job, _w, slot, sset, flags, codec, _n, e, ne, _h, off,
         _s) = hdr.unpack_from(rbuf[i].tobytes(), 0)
        if (magic != MAGIC or mt != _RESULT or job != job_id or slot >= W or cur[slot] < 0
                or sset != (uses[slot] & 1)):
            ignored += 1
            continue
        if drop[i]:
            lost += 1
            continue
        j = int(cur[slot])
        lo = (j - boot) * E if j >= boot else BOOT_OFFSET
        if off != lo:
            ignored += 1
            continue
        if flags & _OVERFLOW:
            return done, nsend, ignored, lost, slot, 1
        want = 1 if j < boot else min(E, d - lo)
        pl = ln - HEADER_LEN
        lane = pl // ne if ne else 0
        if ne != want or codec != _THC or lane * ne != pl or lane not in (1, 2, 4):
            return done, nsend, ignored, lost, slot, 0
        if j < K:
            agreed[j] = e
        if j >= boot:
            t = {1: "<i1", 2: "<i2", 4: "<i4"}[lane]
            qsum[lo:lo + ne] = np.frombuffer(rbuf[i].tobytes(), t, ne, HEADER_LEN)
            s = thc_scale_ref(int(agreed[j - boot]), ne, clip) / half
            z = (fwht((qsum[lo:lo + ne] * s).astype(np.float32).reshape(-1, blk))
                 * np.float32(1.0 / np.sqrt(blk))).ravel()
            neg = (hash_u32(np.arange(lo, lo + ne), skey) & np.uint64(1)).astype(bool)
            hi = min(lo + ne, out.size)
            out[lo:hi] = np.where(neg, -z, z)[:hi - lo]
        done += 1
        st[3] = now
        uses[slot] += 1
        if not retx[slot]:
            sample = now - sent_at[slot]
            if st[0] == 0.0:
                st[0], st[1] = sample, sample / 2
            else:
                st[1] = 0.75 * st[1] + 0.25 * abs(st[0] - sample)
                st[0] = 0.875 * st[0] + 0.125 * sample
            st[2] = min(max(T0, st[0] + 4 * st[1]), T_MAX)
        rto[slot] = st[2]
        retx[slot] = False
        nj = j + W
        if nj < total:
            lens[slot] = thc_build_packet_ref(pkts, slot, nj, x, d, E, K, boot, n, job_id,
                                              rank, int(uses[slot] & 1), agreed, clip, half,
                                              blk, skey, qkey, scratch)
            cur[slot] = nj
            sent_at[slot] = now
            deadline[slot] = now + st[2]
            send_list[nsend] = slot
            nsend += 1
        else:
            cur[slot] = -1
            deadline[slot] = np.inf
    return done, nsend, ignored, lost, -1, 0


def thc_descale_ref(qsum, agreed, E, clip, half):
    """numpy twin of :func:`thc_descale` (returns ysum)."""
    out = np.empty(qsum.size, dtype=np.float32)
    for c, lo in enumerate(range(0, qsum.size, E)):
        hi = min(lo + E, qsum.size)
        s = thc_scale_ref(int(agreed[c]), hi - lo, clip) / half
        out[lo:hi] = (qsum[lo:hi] * s).astype(np.float32)
    return out
