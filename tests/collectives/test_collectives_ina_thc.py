"""INA + THC compression (``CollectiveSpec(algo='ina', compressor='thc')``).

* in-process: n workers' real packets (``inakernel``) through the real switch kernel
  (``AggregateStage``), sums checked against numpy with THC's error bound (``ina.thc_check``),
  and the check rejects wrong decodes;
* Mininet: real UDP packets through the programmable star's aggregate program, n = 2..4 and
  5 % seeded loss, and a quarter of plain INA's packets through the switch for the same bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from inasim import Sim

from testbed.collectives import inakernel as ik
from testbed.collectives.ina import thc_check, thc_elems, thc_layout
from testbed.collectives.report import rank_input
from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.testing import run_direct
from testbed.kernels.compressors import get_compressor
from testbed.kernels.compressors.thc import rht_forward, rht_inverse


def _loopback(xs, g=16, W=4, step=0, **impair):
    """n THC workers' real packets through the real switch kernel (simulated channel);
    return (outputs, packets sent to the switch)."""
    sim = Sim(xs=xs, W=W, mode=ik.MODE_THC, g=g, step=step, **impair)
    ps = sim.run()
    return [p.out for p in ps], sim.stats["to_switch"]


@pytest.mark.parametrize("n, count, g", [(2, 5000, 16), (3, 777, 16), (4, 20000, 16),
                                         (8, 3000, 16), (20, 1500, 16), (4, 4000, 254)])
def test_loopback_sum_within_thc_bound(n, count, g):
    """Real packets through the real switch kernel in-process, over a lossy, duplicating,
    reordering channel: every worker decodes the same vector, within THC's bound of the numpy
    sum (int16 result lanes for g=254 / n=20)."""
    spec = CollectiveSpec(algo="ina", compressor="thc", compressor_params={"granularity": g},
                          nbytes=4 * count, seed=n)
    spec.validate(n)
    xs = [rank_input(spec, r, count) for r in range(n)]
    outs, _ = _loopback(xs, g, loss=0.05, dup=0.05, reorder=0.1)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    err, ok = thc_check(spec, xs, outs, n)
    assert ok, err
    total = np.sum(xs, axis=0, dtype=np.float64)
    # 4-bit THC keeps ~20 % relative L2 error; g=254 (8-bit) ~1.5 %
    rel = np.linalg.norm(outs[0] - total) / np.linalg.norm(total)
    assert rel < (0.3 if g == 16 else 0.03) and (count < 1000 or rel > 0.001)


def test_thc_check_rejects_wrong_results():
    """The correctness check is not vacuous: zeros, an undone rotation, a dropped sign stream,
    a 2x scale and one corrupted packet all fail it."""
    n, count = 4, 8192
    spec = CollectiveSpec(algo="ina", compressor="thc", nbytes=4 * count, seed=1)
    xs = [rank_input(spec, r, count) for r in range(n)]
    outs1, _ = _loopback(xs, step=1)  # the second repetition: other sign/rounding streams
    assert thc_check(spec, xs, outs1, n, step=1)[1]
    outs, _ = _loopback(xs)
    assert thc_check(spec, xs, outs, n)[1]
    assert not np.array_equal(outs[0], outs1[0])
    comp = get_compressor("thc")
    d, blk, skey, _ = thc_layout(comp, count, thc_elems(n, 16), 0, 0)
    unrot = np.empty(d, np.float32)
    rht_forward.serial(outs[0], blk, skey, unrot)  # the rotated domain, not the result
    other = np.empty(count, np.float32)
    rht_inverse.serial(unrot, blk, skey ^ np.uint64(1), count, other)
    corrupt = outs[0].copy()
    corrupt[1024:2048] += 3.0
    for bad in (np.zeros(count, np.float32), unrot[:count], other, outs[0] * 2, corrupt):
        assert not thc_check(spec, xs, [outs[0], bad, outs[0], outs[0]], n)[1]


def test_spec_validation():
    """Only summable compressors that INA implements; clear ValueErrors otherwise."""
    CollectiveSpec(algo="ina", compressor="thc").validate(4)
    with pytest.raises(ValueError, match=r"CollectiveSpec.compressor='topk'.*\('thc',\)"):
        CollectiveSpec(algo="ina", compressor="topk").validate(4)
    with pytest.raises(ValueError, match=r"CollectiveSpec.compressor='fp16'.*\('thc',\)"):
        CollectiveSpec(algo="ina", compressor="fp16").validate(4)
    with pytest.raises(ValueError, match=r"error_feedback"):
        CollectiveSpec(algo="ina", compressor="thc", error_feedback=True).validate(4)
    with pytest.raises(ValueError, match=r"granularity"):
        CollectiveSpec(algo="ina", compressor="thc",
                       compressor_params={"granularity": 3}).validate(4)
    with pytest.raises(ValueError, match=r"compressor='thc'"):
        CollectiveSpec(algo="nic", compressor="thc").validate(4)
    assert thc_elems(4, 16) == 1024 and thc_elems(16, 16) == 512  # 16*8 > 127: int16 lanes


# ------------------------------------------------------------------ Mininet, real packets


@pytest.fixture(scope="module")
def agg_net():
    """4 hosts on a programmable switch (aggregate program), 100 Mb/s links."""
    from testbed.topologies import Star, TestbedNet

    topo = Star(4, bw_mbps=100, switch="programmable",
                programs={"switch": ["aggregate", "forward"]})
    with TestbedNet(topo) as net:
        yield net


def _contributions(net) -> int:
    return net.counters()["datapath"][net.aggregator["switch"]]["stages"]["aggregate"][
        "contributions"]


@pytest.mark.mininet
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ina_thc_on_programmable_star(agg_net, n):
    """n = 2..4 workers, real packets: the sum within THC's bound; 1/4 of INA's packets."""
    count, W = 40_000, 16
    spec = CollectiveSpec(algo="ina", compressor="thc", nbytes=4 * count, window=W,
                          timeout_s=20, seed=n)
    spec.validate(4)
    c0 = _contributions(agg_net)
    xs, outs, _ = run_direct(agg_net, spec, n)
    thc_pkts = _contributions(agg_net) - c0
    err, ok = thc_check(spec, xs, outs, n)
    assert ok, err
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    if n == 4:  # plain INA, same bytes: data packets through the switch (minus the W-packet
        # exponent bootstrap of each worker) drop 4x
        plain = CollectiveSpec(algo="ina", nbytes=4 * count, window=W, timeout_s=20, seed=n)
        c1 = _contributions(agg_net)
        _, pouts, _ = run_direct(agg_net, plain, n)
        ina_pkts = _contributions(agg_net) - c1
        ratio = (thc_pkts - n * W) / (ina_pkts - n * W)
        assert 0.24 <= ratio <= 0.27, (thc_pkts, ina_pkts)
        assert np.allclose(pouts[0], np.sum(xs, axis=0), atol=1e-3)


@pytest.mark.mininet
def test_ina_thc_under_loss(agg_net):
    """5 % seeded loss of contributions and results: retransmissions and the shadow copy
    (answered in the same narrow lanes) still give a sum within the bound."""
    spec = CollectiveSpec(algo="ina", compressor="thc", nbytes=4 * 30_000, window=16,
                          loss=0.05, timeout_s=20, seed=5)
    sw = agg_net.aggregator["switch"]
    before = agg_net.counters()["datapath"][sw]["stages"]["aggregate"]
    xs, outs, _ = run_direct(agg_net, spec, 4)
    after = agg_net.counters()["datapath"][sw]["stages"]["aggregate"]
    err, ok = thc_check(spec, xs, outs, 4)
    assert ok, err
    assert after["retransmissions_answered"] > before["retransmissions_answered"]
