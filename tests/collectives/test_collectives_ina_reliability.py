"""In-network aggregation on real packets under the impairments the testbed offers, strangers
on the fabric and a switch that dies: the suite-sized version of ``testbed bench reliability``
(the same code, small sizes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.bench import reliability as rel
from testbed.datapath.control import RUN_DIR

pytestmark = pytest.mark.mininet
MiB = 1 << 20


def _rows(fn, *args, **kw) -> list[dict]:
    rows: list[dict] = []
    fn(*args, rows.append, **kw)
    return rows


def test_matrix_exact_under_loss_duplication_reordering_star():
    """INA, INA + THC and the SmartNIC-offloaded variant: exact (or within THC's bound) and
    never hung, with each impairment alone and all together, at the aggregating switch."""
    # INA with each impairment alone and all together; its THC and SmartNIC variants (the
    # same worker protocol) with all together. The full matrix is `testbed bench reliability`.
    together = (10, 5, 10)
    scenarios = [(10, 0, 0), (0, 5, 0), (0, 0, 10), together]
    rows = _rows(rel.matrix, "star4", ["ina"], scenarios, MiB // 8)
    rows += _rows(rel.matrix, "star4", ["ina+thc", "nic"], [together], MiB // 8)
    assert [r["algo"] for r in rows] == ["ina"] * 4 + ["ina+thc", "nic"]
    bad = [r for r in rows if r["status"] != "ok"]
    assert not bad, bad


def test_stranger_flood_is_counted_and_harmless():
    """A host outside the job sprays DATA with the job's id, every worker id and slot, from
    its own address and spoofing a member's: the job stays exact, every stray packet is counted
    NOT_MEMBER at the switch."""
    (row,) = _rows(rel.non_member_flood, MiB // 2, 1000.0, "star4")
    assert row["status"] == "ok", row
    counts = {k: row[k] for k in ("stray_sent", "stray_received", "drops_not_member",
                                  "drops_unknown_job")}
    assert row["drops_not_member"] > 0 and row["all_strays_counted"], counts


def test_killed_switch_engine_fails_fast_naming_the_node():
    log = Path(RUN_DIR) / "tbs1.log"
    try:
        (row,) = _rows(rel.engine_killed, MiB // 2, "star4")
        assert row["status"] == "error", row
        assert row["seconds_to_error"] is not None and row["seconds_to_error"] < 5, row
        assert "tbs1" in row["error"] and "exit status -9" in row["error"], row
        assert "BrokenPipe" not in row["error"] and row["leftovers"] == 0, row
        assert log.exists()  # the dead engine's log is kept for whoever reads the error
    finally:
        log.unlink(missing_ok=True)


@pytest.mark.parametrize("algo", ["ina", "ring"])
def test_a_killed_switch_engine_is_restarted_and_the_collective_completes_exact(algo):
    """The default: the dead engine is started again (tables and timing as built); an INA
    collective, whose registration died with it, is registered again and rerun from its
    start; a ring's TCP connections ride the restart out. Every sum checked against numpy."""
    log = Path(RUN_DIR) / "tbs1.log"
    try:
        (row,) = _rows(rel.engine_killed, MiB // 2, "star4", algo=algo, on_death="restart")
        assert row["status"] == "ok" and row["correct"], row
        (node, code, took), = row["engine_restarts"]
        assert (node, code) == ("tbs1", -9) and 0 < took < 60, row
        assert row["rerun"] is (algo == "ina"), row
        if algo == "ina":
            assert row["fallback_s"] >= took - 1e-3, row
        assert row["leftovers"] == 0, row
    finally:
        log.unlink(missing_ok=True)


@pytest.mark.parametrize("algo", ["ina", "ring"])
def test_an_engine_killed_while_the_job_is_set_up_is_restarted_and_the_job_runs(algo,
                                                                               monkeypatch):
    """The switch dies right after the runner found every engine running, before the model
    and the registration ask it anything (a fault at a run's 0 s did that): the job restarts
    it and runs, exact, where it failed (here the model's ping of the hop latency)."""
    import os
    import signal

    from testbed.collectives import CollectiveSpec, run_collective
    from testbed.topologies import Star, TestbedNet

    log = Path(RUN_DIR) / "tbs1.log"
    try:
        with TestbedNet(Star(n_hosts=4, bw_mbps=100, switch="programmable")) as net:
            check, switch, killed = net.dead_engines, net.mininet.get("tbs1"), []

            def check_then_kill():
                found = check()
                if not killed:  # the runner's first look finds tbs1 running; then it dies
                    engine = switch.engine
                    killed.append(switch.engine_pid())
                    os.kill(killed[0], signal.SIGKILL)
                    engine.wait(timeout=10)
                return found

            monkeypatch.setattr(net, "dead_engines", check_then_kill)
            spec = CollectiveSpec(algo=algo, nbytes=MiB // 2)
            rows = run_collective(net, spec)
            monkeypatch.undo()
            (row,) = rows
            assert row["correct"] and row["n"] == 4 and row["bytes"] == spec.nbytes, row
            (node, code, took), = row["engine_restarts"]
            assert killed and (node, code) == ("tbs1", -9) and 0 < took < 60, row
            assert row["rerun"] is True, row
    finally:
        log.unlink(missing_ok=True)


def test_a_killed_worker_ends_its_job_named_and_spares_the_other_tenant():
    """Two tenants on one switch: an INA job on tbh1-tbh2 and a ring on tbh3-tbh4. A worker of
    the INA job killed mid-allreduce ends that job within seconds (not its 30 s timeout) with
    an error naming the rank and host; the ring job stays exact; the INA job's switch
    registration is gone (the same job id registers and runs again, exact)."""
    import threading
    import time

    from testbed.collectives import CollectiveError, CollectiveSpec, run_collective
    from testbed.collectives.testing import kill_process_later
    from testbed.topologies import Star, TestbedNet

    with TestbedNet(Star(n_hosts=4, bw_mbps=20, switch="programmable")) as net:
        ina = CollectiveSpec(op="allreduce", algo="ina", nbytes=8 * MiB, hosts=[0, 1],
                             job_id=1, timeout_s=30)
        ring = CollectiveSpec(op="allreduce", algo="ring", nbytes=2 * MiB, hosts=[2, 3],
                              job_id=2, repetitions=2)
        out: dict = {}

        def tenant(name, spec):
            t0 = time.monotonic()
            try:
                out[name] = run_collective(net, spec)
            except CollectiveError as e:
                out[name] = e
            out[name + "_s"] = time.monotonic() - t0

        killer, killed = kill_process_later("tbw-tbh2", delay_s=2.0)  # the INA job's rank
        threads = [threading.Thread(target=tenant, args=("ina", ina)),
                   threading.Thread(target=tenant, args=("ring", ring))]
        for t in threads:
            t.start()
        for t in [*threads, killer]:
            t.join()
        assert killed, "no rank of the INA job was found in tbh2"
        assert isinstance(out["ina"], CollectiveError), out["ina"]
        assert "rank 1 (tbh2) died (signal SIGKILL)" in str(out["ina"]), out["ina"]
        assert out["ina_s"] < 15, out["ina_s"]  # ended by the death, not the 30 s timeout
        assert not isinstance(out["ring"], Exception), out["ring"]
        assert len(out["ring"]) == 2 and all(r["correct"] for r in out["ring"]), out["ring"]
        again = run_collective(net, CollectiveSpec(op="allreduce", algo="ina", nbytes=MiB,
                                                   hosts=[0, 1], job_id=1))
        assert all(r["correct"] for r in again), again
