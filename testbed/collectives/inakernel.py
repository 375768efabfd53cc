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
        off = np.int64(0)
        for k in range(4):
            off |= np.int64(rbuf[i, _O_CHUNK + k]) << (8 * k)
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
            sample = now - sent_at[slot]
            if st[0] == 0.0:
                st[0] = sample
                st[1] = sample / 2
            else:
                st[1] = 0.75 * st[1] + 0.25 * abs(st[0] - sample)
                st[0] = 0.875 * st[0] + 0.125 * sample
            st[2] = min(max(T0, st[0] + 4 * st[1]), T_MAX)
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
