"""Unit tests of the alpha-beta model, report rows, spec validation and the result check."""

from __future__ import annotations

import math

import numpy as np
import pytest

from testbed.collectives import REPORT_COLUMNS, CollectiveSpec, model
from testbed.collectives.report import check, expected, make_row, rank_input, shard_bounds

B = 100e6  # bit/s
S = 8 << 20
A = 20e-6


def test_goodput_ratios_follow_frame_sizes():
    assert model.goodput_Bps("ring", B) == pytest.approx(B / 8 * 1448 / (1514 + 33))
    assert model.goodput_Bps("ina", B) == pytest.approx(B / 8 * 1024 / (1024 + 74))  # 14+20+8+32
    assert model.goodput_Bps("nic", B) == model.goodput_Bps("ina", B)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 32])
def test_ring_and_hd_formulas(n):
    t = S / model.goodput_Bps("ring", B)
    assert model.predict("allreduce", "ring", n, S, B, A) == pytest.approx(
        2 * (n - 1) * A + 2 * (n - 1) / n * t)
    assert model.predict("reduce_scatter", "ring", n, S, B, A) == pytest.approx(
        (n - 1) * A + (n - 1) / n * t)
    assert model.predict("allgather", "ring", n, S, B, A) == pytest.approx(
        (n - 1) * A + (n - 1) / n * t)
    hd = model.predict("allreduce", "hd", n, S, B, A)
    p = 1 << (n.bit_length() - 1)
    # rounds whose message (S/2, S/4, ...) reaches 64 KiB wait one more latency (rendezvous)
    meet = sum(1 for j in range(1, p.bit_length()) if S / 2 ** j >= 64 * 1024)
    if n & (n - 1) == 0:
        assert hd == pytest.approx(2 * (math.log2(n) + meet) * A + 2 * (n - 1) / n * t)
    else:  # folded ranks pay one extra full-array exchange each way
        assert hd == pytest.approx(2 * (math.log2(p) + meet) * A + 2 * (p - 1) / p * t
                                   + 2 * (A + t))
    lg = math.ceil(math.log2(n))
    assert model.predict("broadcast", "tree", n, S, B, A) == pytest.approx(lg * (A + t))
    assert model.predict("allreduce", "tree", n, S, B, A) == pytest.approx(2 * lg * (A + t))


def test_hd_rendezvous_costs_a_latency_only_in_large_rounds():
    # 8 ranks: messages S/2, S/4, S/8 per pass; at 1 MiB all three reach 64 KiB, at 256 KiB
    # two (128 and 64 KiB), at 64 KiB none (32, 16, 8 KiB): each pass is halving + doubling
    t = lambda s: s / model.goodput_Bps("hd", B)  # noqa: E731
    for s, meet in ((1 << 20, 3), (256 << 10, 2), (64 << 10, 0)):
        assert model.predict("allreduce", "hd", 8, s, B, A) == pytest.approx(
            2 * (3 + meet) * A + 2 * 7 / 8 * t(s))
        assert model.predict("reduce_scatter", "hd", 8, s, B, A) == pytest.approx(
            (3 + meet) * A + 7 / 8 * t(s))


def test_ina_is_independent_of_n_and_beats_ring():
    t = S / model.goodput_Bps("ina", B)
    vals = {model.predict("allreduce", "ina", n, S, B, A) for n in (2, 4, 8, 32)}
    assert len(vals) == 1 and vals.pop() == pytest.approx(t + 2 * A)
    # ring at n=8 moves 2*7/8 = 1.75 S per link: INA/ring ratio ~ 0.936^-1 / 1.75 ...
    r = model.predict("allreduce", "ina", 8, S, B, A) / model.predict("allreduce", "ring", 8,
                                                                      S, B, A)
    assert r == pytest.approx((1547 / 1448) ** -1 * (1094 / 1024) / 1.75, rel=0.01)


def test_reduction_server_link_loads():
    t = S / model.goodput_Bps("rs", B)
    # pipeline fill: each worker link carries its first piece to every one of the m servers
    assert model.rs_chunk_bytes(S, 8) == S // 8 // model.RS_PIECES
    # pieces fit the credit window four times; never below 4 KiB
    assert model.rs_chunk_bytes(S, 1) == model.RS_WINDOW_BYTES // 4
    assert model.rs_chunk_bytes(1000, 4) == 4096
    fill = 8 * model.rs_chunk_bytes(S, 8) / model.goodput_Bps("rs", B)
    assert model.predict("allreduce", "rs", 8, S, B, 0.0, servers=8, colocated=False) == \
        pytest.approx(t + fill)
    fill1 = model.rs_chunk_bytes(S, 1) / model.goodput_Bps("rs", B)
    assert model.predict("allreduce", "rs", 8, S, B, 0.0, servers=1, colocated=False) == \
        pytest.approx(8 * t + fill1)
    # dedicated servers: server links carry n*S/m, worker links S
    assert model.rs_link_load(8, 1, False) == 8.0
    assert model.rs_link_load(8, 8, False) == 1.0
    # co-located: a server host carries (n-1)/m S for its server + (m-1)/m S as a worker
    assert model.rs_link_load(4, 1, True) == pytest.approx(3.0)
    assert model.rs_link_load(4, 4, True) == pytest.approx(1.5)
    assert model.rs_link_load(4, 2, True) == pytest.approx(2.0)


def test_reduction_server_window_follows_the_link_rate():
    c = model.rs_chunk_bytes(8 << 20, 4)
    assert model.rs_window_pieces(c) == model.RS_WINDOW_BYTES // c
    assert model.rs_window_pieces(c, 100e6) == model.RS_WINDOW_BYTES // c
    # 1 Gb/s: 10 ms of the link (1.25 MB) in flight per server flow
    assert model.rs_window_pieces(c, 1e9) == int(1e9 / 8 * 0.01) // c
    assert model.rs_window_pieces(256 << 10) == 2  # never less than double buffering


def test_reduction_server_windows_share_what_a_worker_keeps_in_flight():
    # up to 4 servers each gets a whole window, as measured on the star of 4
    assert model.rs_window_bytes(4) == model.rs_window_bytes(1) == model.RS_WINDOW_BYTES
    # 16 servers share the worker's RS_INFLIGHT_BYTES (15 full windows stood in its uplink)
    assert model.rs_window_bytes(16) == model.RS_INFLIGHT_BYTES / 16
    for size in (4 << 20, 32 << 20):
        c = model.rs_chunk_bytes(size, 16)
        assert c <= model.rs_window_bytes(16) / 4 or c == 4096  # four pieces per window
        assert model.rs_window_pieces(c, 100e6, 16) * c * 16 <= model.RS_INFLIGHT_BYTES
    # a faster link: 40 ms of it in all, 10 ms per server at most
    assert model.rs_window_bytes(16, 1e9) == pytest.approx(1e9 / 8 * 0.04 / 16)
    assert model.rs_window_bytes(2, 1e9) == pytest.approx(1e9 / 8 * 0.01)


@pytest.mark.parametrize("n", [2, 5, 8])
def test_busbw_factors(n):
    assert model.busbw_factor("allreduce", n) == pytest.approx(2 * (n - 1) / n)
    assert model.busbw_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert model.busbw_factor("allgather", n) == pytest.approx((n - 1) / n)
    assert model.busbw_factor("broadcast", n) == 1.0


def test_model_bad_input():
    with pytest.raises(ValueError, match="op="):
        model.predict("alltoall", "ring", 4, S, B, A)
    with pytest.raises(ValueError, match="algo="):
        model.predict("allreduce", "tree2", 4, S, B, A)
    with pytest.raises(ValueError, match="models allreduce only"):
        model.predict("broadcast", "ina", 4, S, B, A)
    with pytest.raises(ValueError, match="bw_bps"):
        model.predict("allreduce", "ring", 4, S, 0, A)


def test_row_has_every_column_and_nccl_bandwidths():
    spec = CollectiveSpec(op="allreduce", algo="ring", nbytes=1_000_000)
    row = make_row(spec, n=4, time_s=0.1, model_s=0.08, cpu_bound=False, max_abs_err=0.0,
                   correct=True, rep=0)
    assert tuple(row) == REPORT_COLUMNS
    assert row["algbw"] == pytest.approx(1e6 * 8 / 0.1 / 1e9)  # Gb/s
    assert row["busbw"] == pytest.approx(row["algbw"] * 1.5)
    assert row["fidelity"] == pytest.approx(0.1 / 0.08)
    assert row["count"] == 250_000


@pytest.mark.parametrize("kw, field", [
    (dict(op="alltoall"), "op"),
    (dict(algo="magic"), "algo"),
    (dict(op="broadcast", algo="ina"), "algo"),
    (dict(dtype="float16"), "dtype"),
    (dict(nbytes=10), "nbytes"),
    (dict(nbytes=0), "nbytes"),
    (dict(window=0), "window"),
    (dict(timeout_s=-1), "timeout_s"),
    (dict(algo="ina", loss=0.7), "loss"),
    (dict(algo="ring", loss=0.05), "loss"),
    (dict(repetitions=0), "repetitions"),
    (dict(error_feedback=True), "error_feedback"),
    (dict(algo="ina", dtype="int32"), "dtype"),
])
def test_bad_spec_names_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"CollectiveSpec\.{field}"):
        CollectiveSpec(**kw).validate(4)


def test_spec_checks_against_the_net():
    with pytest.raises(ValueError, match="workers"):
        CollectiveSpec(workers=9).validate(8)
    with pytest.raises(ValueError, match="power of two"):
        CollectiveSpec(op="allgather", algo="hd").validate(6)
    with pytest.raises(ValueError, match="at most 32 members .* tree='auto'"):
        CollectiveSpec(algo="ina").validate(40)
    # a tree takes more: each switch of it aggregates at most 32 (checked when it is planned)
    CollectiveSpec(algo="ina", placement={"tree": "auto"}).validate(40)
    CollectiveSpec(op="allgather", algo="hd").validate(8)


def test_shard_bounds_cover_uneven_sizes():
    b = shard_bounds(10, 4)
    assert list(b) == [0, 3, 6, 8, 10]
    assert list(shard_bounds(2, 4)) == [0, 1, 2, 2, 2]


def test_check_catches_wrong_results_and_respects_bounds():
    spec = CollectiveSpec(nbytes=4 * 1001)
    n = 3
    ins = [rank_input(spec, r, spec.count) for r in range(n)]
    acc = ins[0].copy()
    for x in ins[1:]:
        acc += x  # float32 sum in a different order than the float64 reference
    err, ok = check(spec, ins, [acc] * n, n)
    assert ok and err < 1e-5
    bad = acc.copy()
    bad[500] += 1e-3
    err, ok = check(spec, ins, [acc, bad, acc], n)
    assert not ok and err == pytest.approx(1e-3, rel=1e-2)
    nan = acc.copy()
    nan[0] = np.nan
    assert check(spec, ins, [nan, acc, acc], n) == (float("inf"), False)
    # int32 must be exact
    ispec = CollectiveSpec(nbytes=4 * 100, dtype="int32")
    ii = [rank_input(ispec, r, 100) for r in range(n)]
    isum = (ii[0] + ii[1] + ii[2]).astype(np.int32)
    assert check(ispec, ii, [isum] * n, n) == (0.0, True)
    isum[3] += 1
    assert check(ispec, ii, [isum] * n, n)[1] is False


def test_ina_error_bound_matches_fixed_point():
    from testbed.kernels import fixedpoint as fp

    spec = CollectiveSpec(algo="ina", nbytes=4 * 1000)
    n = 4
    ins = [rank_input(spec, r, 1000) for r in range(n)]
    got, _ = fp.allreduce(np.stack(ins))
    refs, bounds = expected(spec, ins, n)
    assert np.all(np.abs(got - refs[0]) <= bounds[0])
    assert check(spec, ins, [got] * n, n)[1]
