"""The ``nic_codec`` program: a SmartNIC (bump in the wire) that compresses gradients.

A BlueField-class SmartNIC sits between a host and its ToR; this stage is its data path. The
node has two ports, ``host_port`` and ``net_port``:

* **host -> net**: a testbed frame (``DATA``, ``RETRANSMIT`` or ``RESULT``) whose payload is
  ``FLOAT32`` (``elem_count`` float32) is rewritten with the chosen codec: payload, ``codec``
  field, IPv4/UDP lengths, IPv4 checksum (UDP checksum 0, legal in IPv4):

  - ``fp16`` -> ``Codec.FLOAT16``, ``bf16`` -> ``Codec.BFLOAT16`` (round to nearest even with
    the compressor kernels of ``testbed.kernels.compressors``, half the bytes). A finite value
    that becomes inf (fp16 beyond 65504) sets ``Flags.OVERFLOW``;
  - ``fixed32`` -> ``Codec.INT32``: ATP's fixed-factor quantisation ``round(x * factor)``
    (``testbed.kernels.fixedpoint.atp_quantize_into``), offloading the worker's quantisation
    for in-network aggregation; the factor goes into the header's ``scale`` field; a value
    that does not fit int32 saturates and sets ``Flags.OVERFLOW`` (ATP: resend raw floats);
  - ``sign`` -> ``Codec.SIGN``: EF-signSGD's scaled sign per packet, one bit per element
    (``x >= 0``, element 8b+j in bit j of byte b: ``compressors.signsgd``'s layout) and the
    mean magnitude ``sum|x| / m`` in ``scale``: a 32x smaller payload that decodes to
    ``+-scale`` (``compressors.signsgd.sign_unpack``). The packing is a serial loop here:
    ``signsgd.sign_pack`` dispatches to a parallel kernel, and a ``cache=True`` caller of it
    crashed when loaded from a stale on-disk cache; a 256-element packet needs no threads.

* **net -> host**: ``FLOAT16`` / ``BFLOAT16`` / ``SIGN`` frames are widened back to ``FLOAT32``
  (exactly what the compressor's decode gives); in
  ``fixed32`` mode ``INT32`` frames become ``FLOAT32`` as ``q / scale`` (the header's scale, or
  the configured ``factor`` when it is 0), so the host only ever sees float32.

Everything else (not a testbed frame, other codecs, other message types, a payload that would
not fit ``mtu`` after widening) passes through untouched and is counted. With ``cross_connect``
(default) the stage also sends each frame out of the other port, so it is the node's whole
program; set it False to leave the decision to a later ``wire``/``forward`` stage.

Counters: ``encoded``, ``decoded``, ``bytes_saved`` (frame bytes removed by encoding, net of
nothing: decoding restores them on the far side), ``overflow``, ``passthrough`` (not ours or
nothing to do), ``malformed`` (looked like testbed traffic but failed parsing), ``too_big``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from testbed.datapath.batch import PORT_UNSET, Batch, Stage
from testbed.datapath.trim import check_number, port_index, resolve_ports
from testbed.kernels.compressors.bf16 import bf16_bits
from testbed.kernels.compressors.fp16 import fp16_bits, fp16_to_f32_bits
from testbed.kernels.compressors.signsgd import sign_unpack
from testbed.kernels.fixedpoint import atp_dequantize_into, atp_quantize_into
from testbed.kernels.packets import (
    OFF_UDP_LEN,
    header,
    parse_frame,
    payload_f32,
    payload_i32,
    rd_u16be,
    rd_u16le,
    rd_u32le,
    set_payload_bytes,
    wr_u16le,
    wr_u32le,
)
from testbed.kernels.wire import (
    ETH_LEN,
    FRAME_MAX,
    HEADER_LEN,
    PAYLOAD_OFFSET,
    UDP_LEN,
    Codec,
    DropReason,
    Flags,
    MsgType,
)

#: Codec name -> the wire code it produces.
CODECS = {"fp16": int(Codec.FLOAT16), "bf16": int(Codec.BFLOAT16), "fixed32": int(Codec.INT32),
          "sign": int(Codec.SIGN)}
ATP_FACTOR = 1e6

(C_ENCODED, C_DECODED, C_BYTES_SAVED, C_OVERFLOW, C_PASSTHROUGH, C_MALFORMED,
 C_TOO_BIG) = range(7)
COUNTER_NAMES = ("encoded", "decoded", "bytes_saved", "overflow", "passthrough", "malformed",
                 "too_big")

_F32 = int(Codec.FLOAT32)
_F16 = int(Codec.FLOAT16)
_BF16 = int(Codec.BFLOAT16)
_I32 = int(Codec.INT32)
_SIGN = int(Codec.SIGN)
_FLAG_OVERFLOW = int(Flags.OVERFLOW)
_DATA = int(MsgType.DATA)
_RESULT = int(MsgType.RESULT)
_RETRANSMIT = int(MsgType.RETRANSMIT)
# parse statuses that mean "not a testbed frame at all" (vs. a damaged one)
_NOT_OURS = (int(DropReason.NOT_IPV4), int(DropReason.IP_OPTIONS), int(DropReason.NOT_UDP),
             int(DropReason.BAD_MAGIC), int(DropReason.OTHER))


@njit(cache=True)
def encode_frame(frame, codec, factor, scratch):
    """Rewrite a valid FLOAT32 testbed frame with ``codec`` (a wire code: FLOAT16, BFLOAT16,
    INT32 = ATP fixed point with ``factor``, or SIGN); return ``(new_length, overflow)``.
    ``scratch`` is float32 room for the payload (SIGN packs from a copy, not in place)."""
    h = header(frame)
    m = np.int64(h.elem_count)
    overflow = False
    if codec == _SIGN:
        x = scratch[:m]
        x[:] = payload_f32(frame, m)  # a copy: the packed bits overwrite the floats
        total = 0.0
        for j in range(m):  # EF-signSGD's scale: the mean magnitude, summed in float64
            total += abs(np.float64(x[j]))
        nbytes = (m + 7) // 8
        for b in range(nbytes):
            v = 0
            for j in range(min(8, m - 8 * b)):
                if x[8 * b + j] >= 0.0:
                    v |= 1 << j
            frame[PAYLOAD_OFFSET + b] = v
        h.scale = total / m if m > 0 else 0.0
    elif codec == _I32:
        overflow = atp_quantize_into(payload_f32(frame, m), factor, payload_i32(frame, m))
        h.scale = factor
        nbytes = 4 * m
    else:
        # in place, front to back: element j is read (bytes 4j..4j+3) before bytes 2j..2j+1
        # are written, and those never reach an element not yet read
        for j in range(m):
            f = rd_u32le(frame, PAYLOAD_OFFSET + 4 * j)
            half = fp16_bits(f) if codec == _F16 else bf16_bits(f)
            if (f & 0x7F800000) != 0x7F800000 and (
                    (codec == _F16 and (half & 0x7C00) == 0x7C00)
                    or (codec == _BF16 and (half & 0x7F80) == 0x7F80)):
                overflow = True  # a finite value became inf
            wr_u16le(frame, PAYLOAD_OFFSET + 2 * j, half)
        nbytes = 2 * m
    h.codec = codec
    h.head_bytes = 0  # the float32 layout had no trimmable head
    if overflow:
        h.flags |= _FLAG_OVERFLOW
    return set_payload_bytes(frame, nbytes), overflow


@njit(cache=True)
def decode_frame(frame, factor, scratch_bits):
    """Widen a valid FLOAT16 / BFLOAT16 / INT32 / SIGN testbed frame to FLOAT32 in place (INT32
    as ``q / scale``, the header's scale or ``factor`` when it is 0; SIGN as ``+-scale``);
    return the new length. ``scratch_bits`` is uint8 room for a SIGN payload."""
    h = header(frame)
    m = np.int64(h.elem_count)
    codec = h.codec
    if codec == _SIGN:
        nb = (m + 7) // 8
        bits = scratch_bits[:nb]
        bits[:] = frame[PAYLOAD_OFFSET:PAYLOAD_OFFSET + nb]
        s = h.scale
        sign_unpack(bits, s, -s, payload_f32(frame, m))
        h.scale = 0.0
    elif codec == _I32:
        s = np.float64(h.scale)
        if not s > 0.0:
            s = factor
        atp_dequantize_into(payload_i32(frame, m), s, payload_f32(frame, m))
        h.scale = 0.0
    else:
        # in place, back to front: element j's 2 bytes are read before 4j..4j+3 are written
        for j in range(m - 1, -1, -1):
            half = rd_u16le(frame, PAYLOAD_OFFSET + 2 * j)
            f = fp16_to_f32_bits(half) if codec == _F16 else half << 16
            wr_u32le(frame, PAYLOAD_OFFSET + 4 * j, f)
    h.codec = _F32
    return set_payload_bytes(frame, 4 * m)


@njit(cache=True)
def codec_kernel(buf, length, in_port, out_port, n, host_port, net_port, codec, factor,
                 max_len, cross_connect, counters, scratch, scratch_bits, job_ok):
    """Encode host->net and decode net->host testbed frames of the batch (module docstring)."""
    for i in range(n):
        if out_port[i] != PORT_UNSET:
            continue
        ip_ = in_port[i]
        if ip_ != host_port and ip_ != net_port:
            continue
        if cross_connect:
            out_port[i] = net_port if ip_ == host_port else host_port
        f = buf[i]
        ln = length[i]
        st = parse_frame(f, ln)
        if st != 0:
            counters[C_PASSTHROUGH] += 1
            notours = False
            for r in _NOT_OURS:
                if st == r:
                    notours = True
            if not notours:
                counters[C_MALFORMED] += 1
            continue
        h = header(f)
        if not job_ok[h.job_id]:
            counters[C_PASSTHROUGH] += 1  # a job this NIC does not offload
            continue
        c = h.codec
        t = h.msg_type
        m = np.int64(h.elem_count)
        if ip_ == host_port:
            if c != _F32 or not (t == _DATA or t == _RETRANSMIT or t == _RESULT):
                counters[C_PASSTHROUGH] += 1
                continue
            new_len, ovf = encode_frame(f, codec, factor, scratch)
            counters[C_ENCODED] += 1
            counters[C_BYTES_SAVED] += ln - new_len
            if ovf:
                counters[C_OVERFLOW] += 1
            length[i] = new_len
        else:
            if not (c == _F16 or c == _BF16 or c == _SIGN or (c == _I32 and codec == _I32)):
                counters[C_PASSTHROUGH] += 1
                continue
            if c == _SIGN and rd_u16be(f, OFF_UDP_LEN) - UDP_LEN - HEADER_LEN != \
                    (m + 7) // 8:
                counters[C_PASSTHROUGH] += 1  # parse_frame does not size SIGN payloads
                counters[C_MALFORMED] += 1
                continue
            if PAYLOAD_OFFSET + 4 * m > max_len:
                counters[C_TOO_BIG] += 1
                counters[C_PASSTHROUGH] += 1
                continue
            length[i] = decode_frame(f, factor, scratch_bits)
            counters[C_DECODED] += 1


class CodecStage(Stage):
    """SmartNIC bump-in-the-wire codec (program name ``nic_codec``).

    Settings: ``codec`` (``"fp16"``, ``"bf16"``, ``"fixed32"`` or ``"sign"``), ``factor`` (fixed32's
    quantisation factor, ATP's 1e6 by default), ``host_port`` / ``net_port`` (name or index;
    default the node's first and second port), ``mtu`` (largest IP packet a widened frame may
    become), ``cross_connect`` (also forward to the other port), ``jobs`` (``"all"``, the
    default, or the job ids this NIC offloads; other jobs' frames pass untouched). All can
    change at run time.
    """

    name = "nic_codec"

    def __init__(self, ports: list[str] | None = None, n_ports: int | None = None,
                 codec: str = "fp16", factor: float = ATP_FACTOR, host_port=0, net_port=1,
                 mtu: int = 1500, cross_connect: bool = True, jobs=None):
        self.ports = resolve_ports(ports if ports is not None or n_ports is not None
                                   else ["host", "net"], n_ports, "nic_codec")
        if len(self.ports) < 2:
            raise ValueError(f"nic_codec: a SmartNIC needs 2 ports (host and net), got "
                             f"{self.ports}")
        self.counters_arr = np.zeros(len(COUNTER_NAMES), np.int64)
        self._scratch = np.zeros(FRAME_MAX // 4, np.float32)
        self._scratch_bits = np.zeros(FRAME_MAX, np.uint8)
        self.codec = "fp16"
        self.factor = ATP_FACTOR
        self.host_port, self.net_port = 0, 1
        self.mtu = 1500
        self.cross_connect = True
        self.job_ok = np.ones(1 << 16, np.bool_)
        self.configure(codec=codec, factor=factor, host_port=host_port, net_port=net_port,
                       mtu=mtu, cross_connect=cross_connect, jobs=jobs)

    def configure(self, codec=None, factor=None, host_port=None, net_port=None, mtu=None,
                  cross_connect=None, jobs=None, **unknown) -> None:
        """Change the codec, factor, ports, MTU, cross-connect or the offloaded jobs at run
        time (all-or-nothing). ``jobs``: ``"all"`` or a list of job ids (``[]``: none)."""
        if unknown:
            raise ValueError(f"nic_codec: unknown settings {sorted(unknown)}; use codec, factor, "
                             "host_port, net_port, mtu, cross_connect, jobs")
        job_ok = None
        if jobs is not None:
            job_ok = np.zeros(1 << 16, np.bool_)
            if jobs == "all":
                job_ok[:] = True
            else:
                try:
                    ids = [int(j) for j in jobs]
                except (TypeError, ValueError):
                    raise ValueError(f"nic_codec: jobs must be 'all' or a list of job ids, got "
                                     f"{jobs!r}") from None
                if any(not 0 <= j < 1 << 16 for j in ids):
                    raise ValueError(f"nic_codec: job ids must be 0..65535, got {ids}")
                job_ok[ids] = True
        if codec is not None and codec not in CODECS:
            raise ValueError(f"nic_codec: codec must be one of {sorted(CODECS)}, got {codec!r}")
        if factor is not None:
            factor = check_number("factor", 1e-30, 1e30)(factor)
            if not factor > 0:
                raise ValueError(f"factor: must be > 0, got {factor!r}")
        hp = self.host_port if host_port is None else port_index(self.ports, host_port,
                                                                 "nic_codec: host_port")
        np_ = self.net_port if net_port is None else port_index(self.ports, net_port,
                                                                "nic_codec: net_port")
        if hp == np_:
            raise ValueError(f"nic_codec: host_port and net_port are both {self.ports[hp]!r}; "
                             "give two different ports")
        if mtu is not None:
            mtu = check_number("mtu", 68, FRAME_MAX - ETH_LEN, integer=True)(mtu)
        if codec is not None:
            self.codec = codec
        if factor is not None:
            self.factor = factor
        self.host_port, self.net_port = hp, np_
        if mtu is not None:
            self.mtu = mtu
        if cross_connect is not None:
            self.cross_connect = bool(cross_connect)
        if job_ok is not None:
            self.job_ok = job_ok

    def process(self, batch: Batch, now_ns: int) -> None:
        """Encode/decode the batch's undecided frames (one Numba call)."""
        codec_kernel(batch.buf, batch.length, batch.in_port, batch.out_port, batch.n,
                     self.host_port, self.net_port, CODECS[self.codec], self.factor,
                     ETH_LEN + self.mtu, self.cross_connect, self.counters_arr, self._scratch,
                     self._scratch_bits, self.job_ok)

    def counters(self) -> dict:
        """Encode/decode counters (see the module docstring)."""
        out = {k: int(v) for k, v in zip(COUNTER_NAMES, self.counters_arr, strict=True)}
        out["codec"] = self.codec
        return out
