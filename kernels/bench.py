"""``testbed bench kernels``: every Numba kernel against an anchor measured in the same run.

One row per kernel (``testbed.kernels.benchutil.row``): ``kernel, elements, gbps, anchor,
anchor_gbps, ratio``, plus ``cpu`` (model, LLVM's name for it, widest vector unit: the
ratios depend on it). GB/s counts bytes read plus bytes written, for kernel and anchor alike.
Anchors: numpy ``np.add(a, b, out=c)`` on float32 (12 bytes per element) for the elementwise
kernels (quantise, aggregate, dequantise; timed alternately with each kernel because the
machine may be shared), the numpy twin in ``kernels/reference`` for the others. Each
elementwise kernel has a serial row and a ``[par]`` row (``parallel=True`` form).
numpy's add also pays a read for ownership of its output line that neither count includes;
the whole-tensor kernels avoid it with streaming stores (``testbed.kernels.simd``), which is
how a kernel that moves 8 bytes per element can beat the anchor per counted byte. Packet
kernels run over ``min(elements // 256, 8192)`` frames of 256 elements; their bytes are the
header bytes each touches (documented per row below). The compressor rows come from
``testbed.kernels.compressors.bench_rows(elements)`` when it exists; if it does not, or
fails, a note row says so (``gbps``/``ratio`` None and a ``note`` key).
"""

from __future__ import annotations

import traceback

import numpy as np
from numba import njit

from testbed.kernels import fixedpoint as fp
from testbed.kernels import packets as pk
from testbed.kernels import trimming as tr
from testbed.kernels import wire
from testbed.kernels.benchutil import best_seconds, cpu_description, paired, row
from testbed.kernels.reference import fixedpoint as ref_fp
from testbed.kernels.reference import packets as ref_pk
from testbed.kernels.reference import trimming as ref_tr

CHUNK = fp.DEFAULT_CHUNK
N_WORKERS = 8
TRIM_BITS = 1
MAX_FRAMES = 8192


@njit(cache=True)
def _restore_and_trim(work, pristine, length, orig_len, n):
    """Put back the 70 header bytes and length of each frame, then trim it (so every timed
    call trims all n frames)."""
    done = 0
    for i in range(n):
        work[i, :pk.PAYLOAD_OFFSET] = pristine[i, :pk.PAYLOAD_OFFSET]
        length[i] = orig_len[i]
        r = tr.trim_frame(work[i], length[i])
        if r > 0:
            length[i] = r
            done += 1
    return done


def _elementwise_rows(x: np.ndarray, numpy_add) -> list[dict]:
    n = x.shape[0]
    nch = (n + CHUNK - 1) // CHUNK
    add_bytes = 12 * n
    rows = []
    exps = np.empty(nch, dtype=np.int16)
    q = np.empty(n, dtype=np.int32)
    acc = np.zeros(n, dtype=np.int32)
    out = np.empty(n, dtype=np.float32)
    t_ref = best_seconds(lambda: ref_fp.chunk_exponents(x, CHUNK), repeat=3)
    # (name, serial call, parallel call, bytes moved, anchor)
    cases = [
        ("fixedpoint.exponents", lambda: fp.chunk_exponents_into(x, CHUNK, exps),
         lambda: fp.chunk_exponents_into_par(x, CHUNK, exps), 4 * n + 2 * nch,
         ("numpy twin", t_ref, 4 * n + 2 * nch)),
        ("fixedpoint.quantize", lambda: fp.quantize_chunks_into(x, exps, N_WORKERS, CHUNK, q),
         lambda: fp.quantize_chunks_into_par(x, exps, N_WORKERS, CHUNK, q), 8 * n + 2 * nch,
         None),
        # acc += q repeatedly: the values wrap, the timing is what counts here
        ("fixedpoint.aggregate", lambda: fp.add_into(acc, q), lambda: fp.add_into_par(acc, q),
         12 * n, None),
        ("fixedpoint.dequantize",
         lambda: fp.dequantize_chunks_into(q, exps, N_WORKERS, CHUNK, out),
         lambda: fp.dequantize_chunks_into_par(q, exps, N_WORKERS, CHUNK, out),
         8 * n + 2 * nch, None),
        ("atp.quantize", lambda: fp.atp_quantize_into(x, fp.ATP_FACTOR, q),
         lambda: fp.atp_quantize_into_par(x, fp.ATP_FACTOR, q), 8 * n, None),
        ("atp.aggregate", lambda: fp.atp_add_into(acc, q), lambda: fp.atp_add_into_par(acc, q),
         12 * n, None),
        ("atp.dequantize", lambda: fp.atp_dequantize_into(q, fp.ATP_FACTOR, out),
         lambda: fp.atp_dequantize_into_par(q, fp.ATP_FACTOR, out), 8 * n, None),
    ]
    for name, serial, par, moved, anchor in cases:
        for label, fn in ((name, serial), (name + "[par]", par)):
            if anchor is None:  # numpy add, timed alternately with the kernel
                tk, ta = paired(fn, numpy_add)
                rows.append(row(label, n, tk, moved, "numpy add", ta, add_bytes))
            else:
                rows.append(row(label, n, best_seconds(fn), moved, *anchor))
    return rows


def _trimming_rows(x: np.ndarray) -> list[dict]:
    m = (x.shape[0] // CHUNK) * CHUNK  # the vectorised twin needs whole chunks
    if m == 0:
        return []
    xs = x[:m]
    nch = m // CHUNK
    hb = int(tr.head_bytes_for(CHUNK, TRIM_BITS))
    total = int(tr.total_bytes_for(CHUNK, TRIM_BITS))
    payloads = np.empty((nch, total), dtype=np.uint8)
    nbytes = np.empty(nch, dtype=np.int32)
    t = best_seconds(lambda: tr.encode_chunks_into(xs, CHUNK, TRIM_BITS, 7, payloads, nbytes))
    t_par = best_seconds(
        lambda: tr.encode_chunks_into_par(xs, CHUNK, TRIM_BITS, 7, payloads, nbytes))
    t_ref = best_seconds(lambda: ref_tr.encode_chunks(xs, CHUNK, TRIM_BITS, 7), repeat=3)
    moved = 4 * m + nch * total
    name = f"trimming.encode(b={TRIM_BITS})"
    rows = [row(name, m, t, moved, "numpy twin", t_ref, moved),
            row(name + "[par]", m, t_par, moved, "numpy twin", t_ref, moved)]

    out = np.empty(m, dtype=np.float32)
    t = best_seconds(lambda: tr.decode_chunks_into(payloads, nbytes, CHUNK, out))
    t_ref = best_seconds(lambda: ref_tr.decode_chunks(payloads, CHUNK, False), repeat=3)
    moved = nch * 4 * CHUNK + 4 * m
    rows.append(row("trimming.decode(full)", m, t, moved, "numpy twin", t_ref, moved))

    heads = np.ascontiguousarray(payloads[:, :hb])
    hbytes = np.full(nch, hb, dtype=np.int32)
    t = best_seconds(lambda: tr.decode_chunks_into(heads, hbytes, CHUNK, out))
    t_ref = best_seconds(lambda: ref_tr.decode_chunks(heads, CHUNK, True), repeat=3)
    moved = nch * hb + 4 * m
    rows.append(row("trimming.decode(trimmed)", m, t, moved, "numpy twin", t_ref, moved))
    return rows


def _packet_rows(x: np.ndarray) -> list[dict]:
    frames = min(x.shape[0] // CHUNK, MAX_FRAMES)
    if frames == 0:
        return []
    elements = frames * CHUNK
    hdr = wire.new_headers(frames)
    hdr["msg_type"] = int(wire.MsgType.DATA)
    hdr["codec"] = int(wire.Codec.TRIM_LAYOUT)
    hdr["elem_count"] = CHUNK
    hdr["head_bytes"] = tr.head_bytes_for(CHUNK, TRIM_BITS)
    hdr["chunk_offset"] = np.arange(frames) * CHUNK
    hdr["slot"] = np.arange(frames) % 512
    total = int(tr.total_bytes_for(CHUNK, TRIM_BITS))
    payload = np.empty((frames, total), dtype=np.uint8)
    nbytes = np.empty(frames, dtype=np.int32)
    tr.encode_chunks_into(x[:elements], CHUNK, TRIM_BITS, 1, payload, nbytes)
    smac = np.tile(pk.mac_to_array("02:00:00:00:00:01"), (frames, 1))
    dmac = np.tile(pk.mac_to_array("02:54:42:00:00:fe"), (frames, 1))
    sip = np.full(frames, pk.ip_to_u32("10.0.0.1"), dtype=np.uint32)
    dip = np.full(frames, pk.ip_to_u32("10.0.0.254"), dtype=np.uint32)
    sport = np.full(frames, 40000, dtype=np.uint16)
    dport = np.full(frames, wire.TESTBED_UDP_PORT, dtype=np.uint16)
    buf = np.zeros((frames, pk.FRAME_MAX), dtype=np.uint8)
    length = np.zeros(frames, dtype=np.int32)
    rows = []

    def build():
        pk.build_batch(buf, length, frames, hdr, payload, nbytes, smac, dmac, sip, dip, sport,
                       dport)

    def build_ref():
        macs = (bytes(smac[0]), bytes(dmac[0]))
        for i in range(frames):
            ref_pk.build_frame(hdr[i], payload[i].tobytes(), macs[0], macs[1], int(sip[i]),
                               int(dip[i]), int(sport[i]), int(dport[i]))

    t = best_seconds(build)
    t_ref = best_seconds(build_ref, repeat=3)
    moved = int(2 * length.sum() + hdr.nbytes)  # payload read + frame written + headers read
    rows.append(row("packets.build_batch", elements, t, moved, "python twin", t_ref, moved))

    headers = np.zeros(frames, dtype=wire.HEADER_DTYPE)
    status = np.zeros(frames, dtype=np.uint8)
    t = best_seconds(lambda: pk.parse_batch(buf, length, frames, headers, status))
    t_ref = best_seconds(lambda: ref_pk.parse_batch(buf, length, frames), repeat=3)
    moved = frames * (pk.PAYLOAD_OFFSET + wire.HEADER_LEN + 1)  # headers read, record + status
    rows.append(row("packets.parse_batch", elements, t, moved, "python twin", t_ref, moved))

    work = buf.copy()
    wlen = length.copy()
    t = best_seconds(lambda: _restore_and_trim(work, buf, wlen, length, frames))
    frame_bytes = [bytes(buf[i, : length[i]]) for i in range(frames)]

    def trim_ref():
        for fb in frame_bytes:
            ref_tr.trim_frame(fb)

    t_ref = best_seconds(trim_ref, repeat=3)
    moved = frames * 2 * pk.PAYLOAD_OFFSET  # header region read and rewritten
    rows.append(row("trimming.trim_frame", elements, t, moved, "python twin", t_ref, moved))
    return rows


def _note_row(elements: int, note: str) -> dict:
    return {"kernel": "compressors", "elements": elements, "gbps": None, "anchor": None,
            "anchor_gbps": None, "ratio": None, "note": note}


def _compressor_rows(elements: int) -> list[dict]:
    try:  # imported here: a broken compressor plug-in becomes a note row, not a crash
        from testbed.kernels import compressors
    except Exception as e:  # noqa: BLE001 - report any import failure as a note row
        return [_note_row(elements, f"testbed.kernels.compressors failed to import: {e!r}")]
    fn = getattr(compressors, "bench_rows", None)
    if fn is None:
        return [_note_row(elements, "testbed.kernels.compressors.bench_rows(elements) does not "
                                    "exist yet; no compressor rows")]
    try:
        return list(fn(elements))
    except Exception as e:  # noqa: BLE001 - a failing compressor bench must not hide our rows
        tb = traceback.format_exc(limit=2).strip().splitlines()[-1]
        return [_note_row(elements, f"compressors.bench_rows({elements}) failed: {e!r} ({tb})")]


def _numpy_add_anchor(rng: np.random.Generator, elements: int):
    """The anchor: a call of ``np.add(a, b, out=c)`` on float32 (12 bytes per element)."""
    a = rng.standard_normal(elements, dtype=np.float32)
    b = rng.standard_normal(elements, dtype=np.float32)
    c = np.empty_like(a)
    return lambda: np.add(a, b, out=c)


#: the row groups, in the order they run (``testbed bench kernels --only``)
GROUPS = ("elementwise", "trimming", "packets", "compressors")


def rows(elements: int, only: tuple[str, ...] | None = None) -> list[dict]:
    """Benchmark rows for a float32 gradient of ``elements`` values: every group of
    :data:`GROUPS`, or the groups named in ``only``."""
    if isinstance(elements, bool) or not isinstance(elements, (int, np.integer)) or elements < 1:
        raise ValueError(f"elements: must be a positive int, got {elements!r}")
    groups = GROUPS if not only else tuple(only)
    bad = sorted(set(groups) - set(GROUPS))
    if bad:
        raise ValueError(f"only: unknown group(s) {', '.join(bad)}; choose from "
                         f"{', '.join(GROUPS)}")
    elements = int(elements)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(elements, dtype=np.float32)
    out: list[dict] = []
    if "elementwise" in groups:
        out += _elementwise_rows(x, _numpy_add_anchor(rng, elements))
    if "trimming" in groups:
        out += _trimming_rows(x)
    if "packets" in groups:
        out += _packet_rows(x)
    if "compressors" in groups:
        out += _compressor_rows(elements)
    cpu = cpu_description()
    for r in out:
        r["cpu"] = cpu
    return out
