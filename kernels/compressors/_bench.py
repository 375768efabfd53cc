"""Benchmark rows for the compressor kernels (called by ``testbed bench kernels``).

Anchors are measured in the same run, interleaved with the kernel (anchor, kernel, anchor,
kernel, ... best of each) so that load from other processes hits both alike: numpy
``np.add(a, b, out=c)`` on the same element count for the elementwise codecs (fp16, sign,
qsgd), ``np.argpartition`` for topk, and each kernel's numpy twin for the rest.
``bytes_moved`` counts bytes read plus written.
"""

from __future__ import annotations

import numpy as np

from testbed.kernels.benchutil import paired, row
from testbed.kernels.memory import ef_compensate
from testbed.kernels.reductions import l2norm
from testbed.kernels.reference import compressors as ref
from testbed.kernels.reference import memory as ref_memory
from testbed.kernels.rng import stream_key

from .fp16 import HW_HALF, _encode_hw, fp16_encode
from .natural import natural_encode
from .powersgd import as_matrix, matmul_mq, matrix_shape
from .qsgd import qsgd_quantize
from .randomk import randomk_gather
from .signsgd import _sign_words
from .terngrad import terngrad_quantize
from .thc import padded_length, rht_forward, thc_quantize
from .topk import topk_select


def bench_rows(elements: int, repeat: int = 7) -> list[dict]:
    """Rows (see ``benchutil.row``) for the compressor kernels at ``elements`` float32."""
    n = int(elements)
    if n < 1:
        raise ValueError(f"elements must be a positive element count, got {elements!r}")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    c = np.empty_like(x)
    key = stream_key(0, 1, 7)
    rows = []

    def add():
        np.add(x, b, out=c)

    def vs_add(kernel, serial, nbytes, parallel=None):
        """A row for ``serial`` and, when given, a ``[par]`` row for the prange form."""
        for label, fn in ((kernel, serial), (kernel + "[par]", parallel)):
            if fn is not None:
                t, a = paired(fn, add, repeat)
                rows.append(row(label, n, t, nbytes, "numpy add", a, 12 * n))

    def vs_twin(kernel, fn, twin, nbytes, rounds=5):
        t, a = paired(fn, twin, rounds)
        rows.append(row(kernel, n, t, nbytes, "numpy twin", a, nbytes))

    h16 = np.empty(n, dtype=np.uint16)
    if HW_HALF:
        vs_add("fp16_encode", lambda: _encode_hw.serial(x, h16), 6 * n,
               lambda: _encode_hw.parallel(x, h16))
    else:
        vs_add("fp16_encode (software)", lambda: fp16_encode(x, h16), 6 * n)
    bits = np.empty((n + 7) // 8, dtype=np.uint8)
    vs_add("sign_pack (signsgd)", lambda: _sign_words.serial(x, bits), 4 * n + (n + 7) // 8,
           lambda: _sign_words.parallel(x, bits))
    norm = float(l2norm(x))
    q16 = np.empty(n, dtype=np.int16)
    vs_add("qsgd_quantize (256 levels)", lambda: qsgd_quantize.serial(x, 256, norm, key, q16),
           6 * n, lambda: qsgd_quantize.parallel(x, 256, norm, key, q16))
    # what QsgdCompressor.compress runs: norm pass + quantise pass, each in its parallel form
    # from PAR_MIN elements (bytes counted once: 4 in, 2 out)
    vs_add("qsgd norm+quantize", lambda: qsgd_quantize(x, 256, float(l2norm(x)), key, q16),
           6 * n)

    # topk 1 %: exact selection (sorted indices, ties to the lowest index) vs np.argpartition
    # (unordered, ties arbitrary) on the magnitudes; same bytes for both
    k = max(1, n // 100)
    idx = np.empty(k, dtype=np.int32)
    t, a = paired(lambda: topk_select(x, k, idx), lambda: ref.topk_argpartition(x, k), 3)
    rows.append(row("topk_select (1%, exact)", n, t, 4 * n + 4 * k, "np.argpartition", a,
                    4 * n + 4 * k))

    vals = np.empty(k, dtype=np.float32)
    # a latency-bound gather of a few ms: more rounds against the noise of a shared machine
    vs_twin("randomk_gather (1%)", lambda: randomk_gather(x, k, key, False, vals),
            lambda: ref.randomk_gather(x, k, key, False), 8 * k, rounds=15)
    vs_twin("qsgd_quantize (256 levels)", lambda: qsgd_quantize(x, 256, norm, key, q16),
            lambda: ref.qsgd_quantize(x, 256, norm, key, np.int16), 6 * n)
    q8 = np.empty(n, dtype=np.int8)
    scale = float(np.max(np.abs(x)))
    vs_twin("terngrad_quantize", lambda: terngrad_quantize(x, scale, key, q8),
            lambda: ref.terngrad_quantize(x, scale, key), 5 * n)
    vs_twin("natural_encode", lambda: natural_encode(x, key, h16),
            lambda: ref.natural_encode(x, key), 6 * n)
    d, blk = padded_length(n, 1024)
    y = np.empty(d, dtype=np.float32)
    vs_twin("thc rht_forward (block 1024)", lambda: rht_forward(x, blk, key, y),
            lambda: ref.rht_forward(x, blk, key, d), 4 * n + 4 * d)
    qd = np.empty(d, dtype=np.int8)
    vs_twin("thc_quantize (g=16)", lambda: thc_quantize(y, 4.0, 8, key, qd),
            lambda: ref.thc_quantize(y, 4.0, 8, key), 5 * d)
    m = as_matrix(x)
    q0 = np.random.default_rng(1).standard_normal((matrix_shape(n)[1], 2)).astype(np.float32)
    p = np.empty((m.shape[0], 2), dtype=np.float32)
    vs_twin("powersgd M@Q (rank 2)", lambda: matmul_mq(m, q0, p), lambda: ref.matmul_mq(m, q0),
            4 * n)
    r0 = np.zeros(n, dtype=np.float32)
    vs_twin("ef_compensate", lambda: ef_compensate(x, r0, 1.0, 1.0, c),
            lambda: ref_memory.ef_compensate(x, r0, 1.0, 1.0), 12 * n)
    return rows
