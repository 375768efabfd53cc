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

from testbed.collectives import inakernel as ik
from testbed.collectives.ina import run_direct, thc_check, thc_elems, thc_layout
from testbed.collectives.report import rank_input
from testbed.collectives.spec import CollectiveSpec
from testbed.datapath.aggclient import udp_frame
from testbed.datapath.aggregate import DEFAULT_AGG_IP, DEFAULT_AGG_MAC, AggregateStage
from testbed.datapath.batch import Batch
from testbed.datapath.forward import ip_to_int, mac_to_int
from testbed.kernels.compressors import get_compressor
from testbed.kernels.compressors.thc import rht_forward, rht_inverse
from testbed.kernels.wire import HEADER_OFFSET

AGG_MAC = mac_to_int(DEFAULT_AGG_MAC).to_bytes(6, "big")
AGG_IP = ip_to_int(DEFAULT_AGG_IP).to_bytes(4, "big")


def _loopback(xs, g=16, W=4, step=0):
    """Run n THC workers against an in-process AggregateStage; return (outputs, packets)."""
    n, count = len(xs), xs[0].size
    comp = get_compressor("thc", granularity=g)
    E, half = thc_elems(n, g), float(g // 2)
    stage = AggregateStage(pool_slots=W, jobs={1: {"n_workers": n, "slots": W}})
    ws = []
    for r, x in enumerate(xs):
        d, blk, skey, qkey = thc_layout(comp, count, E, step, r)
        K = -(-d // E)
        w = {"x": x, "d": d, "K": K, "blk": blk, "skey": skey, "qkey": qkey,
             "out": np.full(count, np.nan, np.float32), "scratch": np.empty(E, np.float32),
             "pkts": np.zeros((W, ik.ROW), np.uint8), "lens": np.zeros(W, np.int64),
             "qsum": np.zeros(d, np.int32), "agreed": np.full(K, ik.THC_EXP_ZERO, np.int16),
             "cur": np.full(W, -1, np.int64), "uses": np.zeros(W, np.int64),
             "sent_at": np.zeros(W), "retx": np.zeros(W, np.bool_),
             "deadline": np.full(W, np.inf), "rto": np.full(W, ik.T0),
             "st": np.array([0.0, 0.0, ik.T0, 0.0]), "send": np.zeros(W, np.int64)}
        for s in range(W):
            w["lens"][s] = ik.thc_build_packet(w["pkts"], s, s, x, d, E, K, W, n, 1, r, 0,
                                               w["agreed"], comp.clip, half, blk, skey, qkey,
                                               w["scratch"])
            w["cur"][s] = s
        ws.append(w)
    outbox = [(r, s) for r in range(n) for s in range(W)]
    packets = 0
    while outbox:
        b = Batch(len(outbox) * (n + 1))
        for i, (r, s) in enumerate(outbox):
            f = udp_frame(bytes([2, 0, 0, 0, 0, r]), AGG_MAC, bytes([10, 0, 0, r + 1]), AGG_IP,
                          5000 + r, 41000, bytes(ws[r]["pkts"][s, :ws[r]["lens"][s]]))
            b.buf[i, :len(f)] = np.frombuffer(f, np.uint8)
            b.length[i] = len(f)
        b.n = packets_in = len(outbox)
        packets += packets_in
        stage.process(b, 0)
        outbox = []
        for i in range(packets_in, b.n):
            f = bytes(b.buf[i, :b.length[i]])
            r = int.from_bytes(f[36:38], "big") - 5000
            w = ws[r]
            rb = np.zeros((1, 2048), np.uint8)
            rb[0, :len(f) - HEADER_OFFSET] = np.frombuffer(f[HEADER_OFFSET:], np.uint8)
            res = ik.on_results_thc(
                rb, np.array([len(f) - HEADER_OFFSET]), 1, np.zeros(1, np.bool_), w["pkts"],
                w["lens"], w["x"], w["d"], E, w["qsum"], w["out"], w["agreed"], w["cur"],
                w["uses"], w["sent_at"], w["retx"], w["deadline"], w["rto"], w["st"], 0.0,
                w["K"], W, W, n, 1, r, comp.clip, half, w["blk"], w["skey"], w["qkey"],
                w["send"], w["scratch"])
            assert res[4] == -1, res
            outbox += [(r, int(w["send"][k])) for k in range(res[1])]
    outs = []
    for w in ws:
        assert (w["cur"] == -1).all()
        outs.append(w["out"])
    return outs, packets


@pytest.mark.parametrize("n, count, g", [(2, 5000, 16), (3, 777, 16), (4, 20000, 16),
                                         (8, 3000, 16), (20, 1500, 16), (4, 4000, 254)])
def test_loopback_sum_within_thc_bound(n, count, g):
    """Real packets through the real switch kernel in-process: every worker decodes the same
    vector, within THC's bound of the numpy sum (int16 result lanes for g=254 / n=20)."""
    spec = CollectiveSpec(algo="ina", compressor="thc", compressor_params={"granularity": g},
                          nbytes=4 * count, seed=n)
    spec.validate(n)
    xs = [rank_input(spec, r, count) for r in range(n)]
    outs, _ = _loopback(xs, g)
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
