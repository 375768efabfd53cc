"""bench ina-cost: its echo aggregator and its switch rounds run the real kernels to the end."""

from __future__ import annotations

from testbed.bench import ina_cost


def test_worker_bench_completes_every_packet():
    # the worker takes every echoed RESULT (else RuntimeError) and reports a time per packet
    assert ina_cost.worker_ns(8, W=4, count=3000) > 0


def test_switch_bench_completes_every_round():
    frames, job = ina_cost.switch_frames(n=3, slots=2, rounds=3)
    assert len(frames) == 3 * 2 * 3
    # every round completes: one RESULT per contribution (else RuntimeError)
    assert ina_cost.switch_ns(4, frames, job, n=3) > 0
