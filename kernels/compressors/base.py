"""The compressor interface (GRACE's Compressor abstraction) and its self-describing bytes.

:class:`Compressor` is the base class of every compressor in this package: ``compress`` /
``decompress`` on numpy arrays, ``aggregate`` for the summable ones, ``encode`` / ``decode``
to bytes. :func:`encode_payload` / :func:`decode_payload` are the byte format (no pickle), so
a receiver can decode a payload without knowing in advance which compressor made it.
"""

from __future__ import annotations

import json
import struct

import numpy as np

from testbed.kernels.checks import check_step, check_vector


def count_for_ratio(n: int, ratio: float) -> int:
    """GRACE's element count for a compress ratio: max(1, int(n * ratio)), 0 for n == 0."""
    return 0 if n == 0 else min(n, max(1, int(n * ratio)))


# ----------------------------------------------------------------------------- wire format

_MAGIC = b"TBCZ"
_WIRE_VERSION = 1
_DTYPES = ("float32", "float16", "uint16", "int8", "uint8", "int16", "int32", "float64",
           "int64", "uint32")
_DTYPE_CODE = {np.dtype(d): k for k, d in enumerate(_DTYPES)}


def encode_payload(name: str, params: dict, ctx: dict, payload: tuple) -> bytes:
    """Self-describing bytes: magic, compressor name, JSON params+ctx, then typed arrays.

    Layout (little-endian): ``b"TBCZ" u8 version u8 len(name) name u32 len(meta) meta(JSON)
    u8 n_arrays`` and per array ``u8 dtype_code u8 ndim u32*ndim shape raw-bytes``. No pickle.
    """
    meta = json.dumps({"params": params, "ctx": ctx}, sort_keys=True).encode()
    nb = name.encode()
    parts = [_MAGIC, struct.pack("<BB", _WIRE_VERSION, len(nb)), nb,
             struct.pack("<I", len(meta)), meta, struct.pack("<B", len(payload))]
    for a in payload:
        a = np.asarray(a)
        code = _DTYPE_CODE.get(a.dtype)
        if code is None:
            raise ValueError(f"payload dtype {a.dtype} has no wire code")
        parts.append(struct.pack("<BB", code, a.ndim))
        parts.append(struct.pack(f"<{a.ndim}I", *a.shape))
        parts.append(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes())
    return b"".join(parts)


def decode_payload(data) -> tuple[str, dict, dict, tuple]:
    """Inverse of :func:`encode_payload`: ``(name, params, ctx, payload)``; ValueError if malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"data must be bytes, got {type(data).__name__}")
    mv = memoryview(data).cast("B")
    try:
        if bytes(mv[:4]) != _MAGIC:
            raise ValueError("data is not a testbed compressed payload (bad magic)")
        ver, ln = struct.unpack_from("<BB", mv, 4)
        if ver != _WIRE_VERSION:
            raise ValueError(f"data has wire version {ver}, expected {_WIRE_VERSION}")
        off = 6
        name = bytes(mv[off:off + ln]).decode()
        off += ln
        (lm,) = struct.unpack_from("<I", mv, off)
        off += 4
        meta = json.loads(bytes(mv[off:off + lm]))
        off += lm
        (na,) = struct.unpack_from("<B", mv, off)
        off += 1
        arrays = []
        for _ in range(na):
            code, ndim = struct.unpack_from("<BB", mv, off)
            off += 2
            shape = struct.unpack_from(f"<{ndim}I", mv, off)
            off += 4 * ndim
            dt = np.dtype(_DTYPES[code]).newbyteorder("<")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if off + nbytes > len(mv):
                raise ValueError("data is truncated")
            arr = np.frombuffer(mv[off:off + nbytes], dtype=dt).reshape(shape)
            arrays.append(arr.astype(dt.newbyteorder("="), copy=True))
            off += nbytes
        if off != len(mv):
            raise ValueError(f"data has {len(mv) - off} trailing bytes")
    except (struct.error, IndexError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"data is not a valid compressed payload: {e}") from None
    return name, meta["params"], meta["ctx"], tuple(arrays)


# ----------------------------------------------------------------------------- interface


class Compressor:
    """A gradient compressor (GRACE's Compressor abstraction).

    ``compress(x, step)`` returns ``(payload, ctx)``: a tuple of numpy arrays that travel on
    the wire and a small dict of JSON scalars (length, step, scales) the receiver needs.
    ``decompress(payload, ctx)`` returns float32 of the original length. ``summable`` says
    whether payloads of n workers (compressed with the same ``step`` and shared parameters)
    can be added elementwise (:meth:`aggregate`) and decompressed once to the sum.
    """

    name = "base"
    summable = False
    #: The type a summable compressor's payload (its first array) is added in on a ring:
    #: "float32", "float16", "bfloat16" (decoded, added, rounded back at every hop) or
    #: "levels" (THC's integer levels, int8 or int16 by the number of workers).
    carrier: str = "float32"
    #: True when compress() keeps state between calls (momentum, warm start): use one
    #: instance per tensor.
    stateful = False

    def __init__(self, **params):
        self.params = params

    # subclasses implement these two
    def _compress(self, x: np.ndarray, step: int) -> tuple[tuple, dict]:
        raise NotImplementedError

    def _decompress(self, payload: tuple, ctx: dict) -> np.ndarray:
        raise NotImplementedError

    def payload_bytes(self, n_elements: int) -> int:
        """Bytes of the payload arrays for an ``n_elements`` gradient (upper bound when the
        size depends on the data); the encoded form adds a small header with the ctx."""
        raise NotImplementedError

    def compress(self, x: np.ndarray, step: int = 0) -> tuple[tuple, dict]:
        """Compress a finite 1-D float32 gradient; ``step`` selects the shared random stream."""
        x = check_vector(x)
        return self._compress(x, check_step(step))

    def decompress(self, payload: tuple, ctx: dict) -> np.ndarray:
        """Rebuild the float32 gradient from ``payload`` and ``ctx`` (as returned by compress)."""
        if not isinstance(payload, tuple):
            raise ValueError(f"payload must be the tuple returned by compress(), got "
                             f"{type(payload).__name__}")
        if not isinstance(ctx, dict) or "n" not in ctx:
            raise ValueError("ctx must be the dict returned by compress() (it has no 'n')")
        return self._decompress(payload, ctx)

    def aggregate(self, payloads: list) -> tuple:
        """Elementwise sum of n workers' payloads, as the network would add them.

        Only for ``summable`` compressors; every worker must have used the same ``step`` and
        shared parameters, and the result decompresses with any one worker's ctx.
        """
        if not self.summable:
            raise ValueError(f"compressor {self.name!r} is not summable; gather the payloads "
                             "and decompress each (e.g. allgather) instead")
        if not payloads:
            raise ValueError("payloads must hold at least one worker's payload")
        shapes = {tuple(a.shape for a in p) for p in payloads}
        if len(shapes) != 1:
            raise ValueError(f"payloads differ in shape {sorted(shapes)}; workers must compress "
                             "tensors of the same length with the same parameters")
        return self._aggregate(payloads)

    def _aggregate(self, payloads: list) -> tuple:
        raise NotImplementedError

    def encode(self, x: np.ndarray, step: int = 0) -> bytes:
        """Compress ``x`` and serialise payload + ctx + parameters to self-describing bytes."""
        payload, ctx = self.compress(x, step)
        return self.encode_compressed(payload, ctx)

    def encode_compressed(self, payload: tuple, ctx: dict) -> bytes:
        """Serialise an already compressed (or aggregated) payload with its ctx."""
        return encode_payload(self.name, self.params, ctx, payload)

    def decode(self, data: bytes) -> np.ndarray:
        """Decompress bytes produced by :meth:`encode` of a compressor of the same name."""
        name, _params, ctx, payload = decode_payload(data)
        if name != self.name:
            raise ValueError(f"data was encoded by compressor {name!r}, not {self.name!r}; "
                             "use testbed.kernels.compressors.decode_any(data)")
        return self.decompress(payload, ctx)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(self.params.items()))
        return f"{type(self).__name__}({args})"
