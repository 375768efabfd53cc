"""Benchmark rows for the compressor kernels (called by ``testbed bench kernels``).

Anchors are measured in the same run: numpy ``np.add(a, b, out=c)`` on the same element count
for the elementwise codecs (fp16, sign, qsgd), ``np.argpartition`` for topk, and each
kernel's numpy twin for the rest. ``bytes_moved`` counts bytes read plus written.
"""

from __future__ import annotations

import numpy as np
from testbed.kernels.benchutil import best_seconds, row
from testbed.kernels.reference import compressors as ref

from . import get_compressor
from ._common import l2norm, stream_key
from .fp16 import fp16_encode
from .natural import natural_encode
from .qsgd import qsgd_quantize
from .randomk import randomk_gather
from .signsgd import sign_pack
from .terngrad import terngrad_quantize
from .thc import padded_length, rht_forward, thc_quantize
from .topk import gather, topk_select


def bench_rows(elements: int, repeat: int = 5) -> list[dict]:
    """Rows (see ``benchutil.row``) for the compressor kernels at ``elements`` float32."""
    from testbed.kernels.memory import ef_compensate

    n = int(elements)
    if n < 1024:
        raise ValueError(f"elements must be at least 1024 for a meaningful benchmark, got {n}")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    c = np.empty_like(x)
    key = stream_key(0, 1, 7)
    rows = []

    def best(fn):
        return best_seconds(fn, repeat=repeat)

    t_add = best(lambda: np.add(x, b, out=c))
    add_bytes = 12 * n

    def vs_add(kernel, fn, nbytes):
        rows.append(row(kernel, n, best(fn), nbytes, "numpy add", t_add, add_bytes))

    h16 = np.empty(n, dtype=np.uint16)
    vs_add("fp16_encode", lambda: fp16_encode(x, h16), 6 * n)
    bits = np.empty((n + 7) // 8, dtype=np.uint8)
    vs_add("sign_pack (signsgd)", lambda: sign_pack(x, bits), 4 * n + (n + 7) // 8)
    norm = float(l2norm(x))
    q16 = np.empty(n, dtype=np.int16)
    vs_add("qsgd_quantize (256 levels)", lambda: qsgd_quantize(x, 256, norm, key, q16), 6 * n)
    vs_add("qsgd incl. l2norm pass", lambda: qsgd_quantize(x, 256, float(l2norm(x)), key, q16),
           6 * n)

    # topk 1 %: exact selection vs np.argpartition (which does not even sort or break ties)
    k = max(1, n // 100)
    idx = np.empty(k, dtype=np.int32)
    tk_bytes = 4 * n + 4 * k
    t_ap = best(lambda: ref.topk_argpartition(x, k))
    rows.append(row("topk_select (1%, exact)", n, best(lambda: topk_select(x, k, idx)), tk_bytes,
                    "np.argpartition", t_ap, tk_bytes))

    def vs_twin(kernel, fn, twin, nbytes):
        rows.append(row(kernel, n, best(fn), nbytes, "numpy twin", best(twin), nbytes))

    vals = np.empty(k, dtype=np.float32)
    vs_twin("randomk_gather (1%)", lambda: randomk_gather(x, k, key, False, vals),
            lambda: ref.randomk_gather(x, k, key, False), 8 * k)
    vs_twin("topk gather (1%)", lambda: gather(x, idx, vals), lambda: x[idx], 12 * k)
    vs_twin("fp16_encode", lambda: fp16_encode(x, h16), lambda: ref.fp16_encode(x), 6 * n)
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
    ps = get_compressor("powersgd", rank=2)
    from .powersgd import as_matrix, matmul_mq
    m = as_matrix(x)
    q0 = ps.initial_q(n)
    p = np.empty((m.shape[0], 2), dtype=np.float32)
    vs_twin("powersgd M@Q (rank 2)", lambda: matmul_mq(m, q0, p), lambda: ref.matmul_mq(m, q0),
            4 * n)
    r0 = np.zeros(n, dtype=np.float32)
    vs_twin("ef_compensate", lambda: ef_compensate(x, r0, 1.0, 1.0, c),
            lambda: ref.ef_compensate(x, r0, 1.0, 1.0), 12 * n)
    return rows
