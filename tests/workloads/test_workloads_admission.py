"""A trace job whose INA registration a switch refuses for memory waits for it (Mininet, real
packets): its own network, since the switch's memory is what the test sizes."""

from __future__ import annotations

import pytest

from testbed.collectives.testing import leftovers
from testbed.topologies import Star, TestbedNet
from testbed.topologies.pipeline import DatapathOptions
from testbed.workloads import TrainingSpec, run_trace

pytestmark = pytest.mark.mininet


def test_start_refused_for_memory_waits_until_it_is_given_back():
    """A switch with memory for one INA job: the second job's registration is refused while
    the first holds the memory (as when a provider re-plans a job that has not moved yet), so
    it waits, starts once the first has given the memory back, and says how long it waited."""
    one_job = {"memory_bytes": 3 * 64 << 10, "pool_bytes": 0}  # a window of 64: 128 KiB
    specs = [TrainingSpec(name="a", algo="ina", hosts=[0, 1], iterations=12, job_id=3),
             TrainingSpec(name="b", algo="ina", hosts=[2, 3], iterations=4, start_s=0.2,
                          job_id=4)]
    said: list[str] = []
    with TestbedNet(Star(4, bw_mbps=100, switch="programmable"),
                    datapath=DatapathOptions(aggregate=one_job)) as net:
        a, b = run_trace(net, specs, progress=said.append)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.summary["correct"] and b.summary["correct"]
    assert a.summary["queued_s"] == 0 and b.summary["queued_s"] > 0
    assert b.summary["start_s"] >= a.summary["end_s"] - 0.2  # after a gave its memory back
    assert any("waits for switch memory" in t and "AdmissionError" in t for t in said), said
    assert not leftovers()
