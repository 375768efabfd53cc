"""The notebooks' live fabric view: it follows real networks through their watcher hook, reads
real counters while a collective runs, detaches cleanly, and its Stop ends a run keeping what
it produced. The drawing and the hook's contract also without a network."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

import pytest

from testbed.experiment.live import FabricView
from testbed.topologies import Star
from testbed.topologies import net as tbnet


class _Net:
    """Stands in for a TestbedNet where only its announcement matters."""


def test_watchers_hear_up_and_down_and_never_break_a_network():
    heard = []

    def broken(net):
        raise RuntimeError("a watcher's bug")

    early, late = _Net(), _Net()
    tbnet._announce(early, True)  # up before anyone watches: told at once
    try:
        with tbnet.watch_networks(lambda n: heard.append(("up", n)),
                                  lambda n: heard.append(("down", n))), \
                tbnet.watch_networks(broken, broken):
            assert heard == [("up", early)]
            tbnet._announce(late, True)
            tbnet._announce(late, False)
            tbnet._announce(late, False)  # told once only
    finally:
        tbnet._announce(early, False)
    assert heard == [("up", early), ("up", late), ("down", late)]
    assert broken not in {w[0] for w in tbnet._WATCHERS} and not {early, late} & set(tbnet._UP)


def test_the_view_draws_without_a_display_or_a_network():
    view = FabricView()
    fig = view.update()  # no network yet: a placeholder figure
    assert fig is not None and view.updates == 0
    desc = Star(n_hosts=3, bw_mbps=100, switch="programmable").describe()
    view.desc = desc
    view.links = {("tbh1", "tbs1"): {"utilisation": 0.9, "queue_bytes": 3000, "drops": 4,
                                     "trims": 0, "bytes": 10, "rate_mbps": 100.0,
                                     "new_drops": 2, "new_trims": 0}}
    view.memory = {"tbs1": {"configured": 16 << 20, "jobs": {"1": 1 << 20}}}
    fig = view.update()
    texts = [t.get_text() for t in fig.axes[0].texts if t.get_visible()]
    assert "q 3 kB +2 dropped" in texts and "INA 1.00/16 MiB" in texts
    assert view.frame()[:2] == b"\xff\xd8" and view.png()[:4] == b"\x89PNG"
    assert "job 1: 1.00 MiB" in view._side_text()


def test_a_launched_job_stops_on_the_stop_event(tmp_path):
    from testbed.launch import _wait

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]
    stop = threading.Event()
    try:
        threading.Timer(0.3, stop.set).start()
        t0 = time.monotonic()
        failed, why = _wait(procs, [None, None], [[], []], 60.0, stop)
        assert failed == [0, 1] and "stopped on request" in why[0]
        assert time.monotonic() - t0 < 5
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _cell(kc, code: str, during=None, timeout: float = 60) -> str:
    """Run ``code`` in the kernel of ``kc``; ``during()`` once it started; its printed text."""
    msg_id = kc.execute(code)
    if during is not None:
        during()
    out = []
    while True:
        m = kc.get_iopub_msg(timeout=timeout)
        if m["parent_header"].get("msg_id") != msg_id:
            continue
        if m["msg_type"] == "stream":
            out.append(m["content"]["text"])
        elif m["msg_type"] == "error":
            out.append("\n".join(m["content"]["traceback"]))
        elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            return "".join(out)


def test_the_stop_button_is_heard_while_a_cell_awaits_the_run():
    """In a real kernel: a click on the Stop button reaches the run while the cell awaits it
    (the kernel dispatches widget messages during an await, not during a blocking call)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        comm_id = _cell(kc, "import time\n"
                            "from testbed.experiment.live import FabricView\n"
                            "def job(stop):\n"
                            "    t0 = time.monotonic()\n"
                            "    stop.wait(60)\n"
                            "    return time.monotonic() - t0\n"
                            "view = FabricView()\n"
                            "display(view)\n"
                            "print(view._ui['button'].comm.comm_id)").strip().splitlines()[-1]

        def click() -> None:
            time.sleep(1.5)
            kc.shell_channel.send(kc.session.msg("comm_msg", {
                "comm_id": comm_id, "data": {"method": "custom",
                                             "content": {"event": "click"}}}))

        out = _cell(kc, "took = await view.start(job)\nprint(f'took {took:.1f} s')", click)
        assert out.startswith("took ") and float(out.split()[1]) < 20, out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.mininet
def test_the_view_follows_a_real_collective_and_detaches():
    from testbed.collectives import CollectiveSpec, run_collective
    from testbed.topologies import TestbedNet

    view = FabricView(period_s=0.2)
    with view.watching():
        with TestbedNet(Star(n_hosts=3, bw_mbps=100, switch="programmable")) as net:
            assert view.net is net and view.attached == 1
            rows = run_collective(net, CollectiveSpec(op="allreduce", algo="ina",
                                                      nbytes=1 << 20, repetitions=2))
            time.sleep(0.5)  # a few updates after the last packet
            during = view.updates
        assert view.net is None and view.detached == 1
    assert all(r["correct"] for r in rows)
    assert during >= 3, f"only {during} updates while the network was up"
    assert not view.errors, view.errors
    for h in ("tbh1", "tbh2", "tbh3"):  # every worker sent its part and got the sum
        assert view.links[(h, "tbs1")]["bytes"] > 1 << 20
        assert view.links[("tbs1", h)]["bytes"] > 1 << 20
    assert "tbs1" in view.memory and view.memory["tbs1"]["configured"] > 0
    assert view.update() is not None  # the last picture stays, with no network to read
    assert net not in tbnet._UP and (view._up, view._down) not in tbnet._WATCHERS
    assert not [t for t in threading.enumerate() if t.name == "tb-fabric-view"]


@pytest.mark.mininet
def test_stop_ends_an_experiment_between_runs_keeping_its_rows(tmp_path):
    """Stopped when the sweep's second network is up: the first point's run is kept, the
    second point never runs, its network is torn down, the status says stopped."""
    view = FabricView()
    ups = []

    def second_up(net):
        ups.append(net)
        if len(ups) == 2:
            view.stop()

    exp = {"name": "stopme", "topology": {"kind": "star", "n_hosts": 2, "bw_mbps": 100,
                                          "switch": "programmable"},
           "jobs": [{"algo": "ina", "nbytes": "16KiB"}],
           "sweep": {"topology.n_hosts": [2, 3]}}
    with tbnet.watch_networks(second_up):
        run = view.run(exp, out_dir=tmp_path / "res", progress=False, doctor=False)
        try:
            res = run.result(timeout=240)
        finally:  # a failed wait leaves no run (and no network) behind
            view.stop()
            with contextlib.suppress(Exception):
                run.result(timeout=120)
    assert res.metadata["status"] == "stopped"
    assert len(res.df) == 1 and (res.df["status"] == "ok").all() and res.df["correct"].all()
    assert view.attached == view.detached == 2 and not view.running
