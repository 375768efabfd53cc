"""The INA workers' delay-based congestion window (``CollectiveSpec.ina_cc="delay"``): kernel
and twin agree on every input; packets go out in order within the window, the window stays
in [1, W] and reacts to round trips (increase below the target, decrease above it at most once
per round trip, halving on a timeout); members with different windows never deadlock and the
sums stay exact under loss, duplication and reordering (real switch kernels, simulated
channels); the spec field is validated."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from inasim import Sim
from test_collectives_inakernel import assert_same, make, on_burst, result

from testbed.collectives import CollectiveSpec
from testbed.collectives import inakernel as ik
from testbed.collectives.reference import inakernel as ref
from testbed.collectives.spec import FieldError
from testbed.kernels.wire import MsgType, unpack_header


def with_cc(state, cwnd: float, margin_s: float):
    loop = state[1]
    loop[0]["cc"], loop[0]["cwnd"], loop[0]["margin"] = ik.CC_DELAY, cwnd, margin_s
    return state


def _sent_packets(slots, send_list, k):
    """Packet indices of the DATA (not RETRANSMIT) rows listed."""
    return [int(slots.cur[s]) for s in send_list[:k]
            if unpack_header(slots.pkts[s].tobytes())["msg_type"] == MsgType.DATA]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), W=st.sampled_from([1, 3, 8]),
       cwnd0=st.sampled_from([0.0, 1.0, 2.5, 8.0]), mode=st.sampled_from([ik.MODE_INT32,
                                                                          ik.MODE_NIC]))
@example(seed=53097, W=8, cwnd0=0.0, mode=ik.MODE_INT32)  # a resend right after a decrease
def test_windowed_kernel_matches_twin(seed, W, cwnd0, mode):
    """Random bursts of answers (in any order, with junk and drops), round trips that swing
    above and below the target and timer expiries: kernel and twin agree on every field, every
    listed row and every return value; DATA packets go out in packet order, each on slot
    ``j % W``, at most ``cwnd`` outstanding after a new packet goes out; the window stays in [1, W]."""
    rng = np.random.default_rng(seed)
    count = 256 * 9 + 5
    a, b = make(mode, W, count, seed=seed, seq0=(1 << 32) - 3)
    with_cc(a, cwnd0, 0.002)
    with_cc(b, cwnd0, 0.002)
    sl = np.zeros(W, np.int64), np.zeros(W, np.int64)
    ka = ik.start(a[0], a[1], a[2], 0.0, sl[0])
    kb = ref.start(b[0], b[1], b[2], 0.0, sl[1])
    assert ka == kb and np.array_equal(sl[0][:ka], sl[1][:kb])
    assert_same(a, b)
    sent = _sent_packets(a[0], sl[0], ka)
    total = a[2].K + a[2].boot
    rbuf = np.zeros((16, 2048), np.uint8)
    done, now = 0, 0.0
    while done < total:
        now += float(rng.choice([0.0005, 0.001, 0.02]))  # round trips below / above target
        live = [s for s in range(W) if a[0].cur[s] >= 0]
        assert live, "nothing outstanding and nothing sent: a stall"
        msgs = [result(rng, a, s) for s in rng.permutation(live)][:rng.integers(1, W + 1)]
        msgs += [result(rng, a, live[0], seq_delta=-1)]  # a duplicate of the last round
        rlen = np.zeros(16, np.int64)
        for i, m in enumerate(msgs):
            rbuf[i, :len(m)] = np.frombuffer(m, np.uint8)
            rlen[i] = len(m)
        drop = rng.random(16) < 0.1
        ra = on_burst(a, rbuf, rlen, len(msgs), drop, now, sl[0])
        rb = ref.on_results(rbuf, rlen, len(msgs), drop, b[0], b[1], b[2], now, sl[1])
        assert tuple(int(v) for v in ra) == tuple(int(v) for v in rb)
        assert ra[4] == -1
        assert np.array_equal(sl[0][:ra[1]], sl[1][:rb[1]])
        assert_same(a, b)
        fresh = _sent_packets(a[0], sl[0], ra[1])
        sent += fresh
        done += ra[0]
        st_ = a[1][0]
        assert 1.0 <= st_["cwnd"] <= W
        assert st_["inflight"] == int((a[0].cur >= 0).sum())
        if fresh:  # a resend adds nothing outstanding: the window may have shrunk below it
            assert st_["inflight"] <= max(int(st_["cwnd"]), 1)
        if rng.random() < 0.25:
            ea = ik.expire_flat(tuple(a[0]), a[1], now + 1.0, sl[0])
            eb = ref.expire(b[0], b[1], now + 1.0, sl[1])
            assert ea == eb and np.array_equal(sl[0][:ea], sl[1][:eb])
            assert_same(a, b)
    assert sent == list(range(total))  # every packet once as DATA, in packet order
    assert (a[0].cur == -1).all() and a[1][0]["inflight"] == 0


def _answer(state, sl, s, now, rng):
    slots, loop, p = state
    m = result(rng, state, s)
    rb = np.zeros((1, 2048), np.uint8)
    rb[0, :len(m)] = np.frombuffer(m, np.uint8)
    return ik.on_results(rb, np.array([len(m)]), 1, np.zeros(1, np.bool_), slots, loop, p,
                         now, sl)


def test_window_rules():
    """Additive increase of 1/cwnd per clean answer below the target; above it one decrease
    per round trip (Swift's factor, at most a half), never below one packet; a full window
    holds the next packet back until an answer frees room; a timeout halves the window."""
    W = 8
    rng = np.random.default_rng(3)
    state, _ = make(ik.MODE_INT32, W, 256 * 40)
    slots, loop, p = with_cc(state, 4.0, 0.002)
    sl = np.zeros(W, np.int64)
    assert ik.start(slots, loop, p, 0.0, sl) == 4 and sl[:4].tolist() == [0, 1, 2, 3]
    st_ = loop[0]
    # a clean 1 ms answer: the least round trip, under the target: +1/4, room for one more
    r = _answer(state, sl, 0, 0.001, rng)
    assert st_["base_rtt"] == 0.001 and st_["cwnd"] == 4.25
    assert sl[:r[1]].tolist() == [4] and slots.cur[4] == 4  # one out, one in: 4 outstanding
    # 20 ms round trips: far above the target 1.5 ms + 2 ms; one decrease for the window
    target = 0.001 * ik.CC_TARGET_FACTOR + 0.002
    r = _answer(state, sl, 1, 0.020, rng)
    cut = max(1 - ik.CC_BETA * (0.020 - target) / 0.020, 1 - ik.CC_MAX_MDF)
    assert st_["cwnd"] == pytest.approx(4.25 * cut) and r[1] == 0  # 3 outstanding, cwnd 2.1
    r = _answer(state, sl, 2, 0.021, rng)  # sent before the decrease: no second one
    assert st_["cwnd"] == pytest.approx(4.25 * cut) and r[1] == 0
    assert st_["inflight"] == 2 and int(st_["cwnd"]) == 2
    # the window is full: slot 5's packet waits even though its slot is idle
    assert slots.cur[5] == -1 and st_["nxt"] == 5
    r = _answer(state, sl, 3, 0.0215, rng)  # above the target again, sent before: no cut
    assert sl[:r[1]].tolist() == [5]  # an answer frees room: the next packet goes
    # never below one packet
    for _ in range(6):
        s = int(np.nonzero(slots.cur >= 0)[0][0])
        _answer(state, sl, s, float(slots.sent_at[s]) + 0.5, rng)
        assert st_["cwnd"] >= 1.0
    assert st_["cwnd"] == 1.0
    # a timeout halves it (at most once per round trip); the resend is unchanged
    st_["cwnd"] = 6.0
    st_["dec_order"] = 0
    k = ik.expire(slots, loop, 1e3, sl)
    assert k == st_["inflight"] and st_["cwnd"] == 3.0


@pytest.mark.parametrize("kernels", [ik, ref], ids=["kernel", "twin"])
def test_members_with_different_windows_finish_exactly(monkeypatch, kernels):
    """Three workers whose windows start at 1, 3 and W, over channels that lose, duplicate and
    reorder (so the windows move apart further): every round completes (no member waits for
    a packet another member's window holds back) and every worker holds the exact sum."""
    starts = iter([1.0, 3.0, 0.0] * 2)
    orig = ik.new_loop
    monkeypatch.setattr(ik, "new_loop", lambda now, *a, **k: orig(
        now, cc=ik.CC_DELAY, cwnd=next(starts), margin_s=1e-4))
    sim = Sim(n=3, W=8, count=256 * 30 + 3, seed=4, loss=0.03, dup=0.03, reorder=0.2,
              kernels=kernels)
    ps = sim.run(max_time_s=60.0)
    want = sim.expected_qsum(ps[0])
    for p in ps:
        assert np.array_equal(p.qsum, want)
        assert np.isfinite(p.out).all()


def test_same_run_kernel_and_twin(monkeypatch):
    """The simulated run with the window on gives the same sums from kernel and twin."""
    orig = ik.new_loop
    monkeypatch.setattr(ik, "new_loop", lambda now, *a, **k: orig(
        now, cc=ik.CC_DELAY, cwnd=2.0, margin_s=1e-4))
    outs = []
    for kernels in (ik, ref):
        sim = Sim(n=2, W=4, count=256 * 12, seed=9, reorder=0.3, kernels=kernels)
        outs.append([p.out.copy() for p in sim.run()])
    for a, b in zip(*outs, strict=True):
        assert np.array_equal(a, b)


def test_spec_field():
    assert CollectiveSpec().ina_cc is None
    CollectiveSpec(algo="ina", ina_cc="delay").validate(4)
    CollectiveSpec(algo="nic", ina_cc="delay").validate(4)
    with pytest.raises(FieldError, match=r"ina_cc='ecn' must be one of \('delay',\)"):
        CollectiveSpec(algo="ina", ina_cc="ecn").validate(4)
    with pytest.raises(FieldError, match="applies to in-network aggregation") as info:
        CollectiveSpec(algo="ring", ina_cc="delay").validate(4)
    assert info.value.field == "ina_cc"
