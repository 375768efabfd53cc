"""``testbed launch --provider``: an unmodified script's job as one tenant of a provider that
serves the network ``testbed up`` runs (``testbed provider serve --attach``), admitted with
its hints, running on the provider's switch registrations, moved while it runs by the plan
changes the provider pushes (another tenant's arrival and departure), its hints derived from
its first iterations when it states no bytes (needs the ``[torch]`` extra)."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the [torch] extra is not installed")

from testbed.datapath.control import DatapathClient  # noqa: E402
from testbed.launch import launch  # noqa: E402
from testbed.provider.client import ProviderClient  # noqa: E402
from testbed.provider.schema import Hints, JobRequest  # noqa: E402

pytestmark = pytest.mark.mininet

TB = [sys.executable, "-m", "testbed.cli"]
FABRIC = ('name = "fabric"\n[topology]\nkind = "star"\nn_hosts = 6\nbw_mbps = 100\n'
          'switch = "programmable"\naggregator = "tbs1"\n'
          '[[jobs]]\nname = "x"\nalgo = "ring"\nnbytes = "1MiB"\n')


def _held() -> set[int]:
    with DatapathClient("tbs1") as c:
        return {int(j) for j in c.counters()["stages"]["aggregate"]["jobs"]}


def _calls(pattern: str) -> int:
    return sum(len(open(p).read().splitlines()) for p in glob.glob(pattern))


def test_a_launched_job_is_a_tenant_of_the_served_provider(tmp_path):
    from testbed.experiment.networks import attach_up
    from testbed.provider.service import Server, make_service

    script = Path(__file__).resolve().parents[2] / "examples" / "torch" / "steps_loop.py"
    exp = tmp_path / "fabric.toml"
    exp.write_text(FABRIC)
    sock = f"unix:{tmp_path / 'p.sock'}"
    with pytest.raises(ValueError, match="no network is up"):
        launch(script, ["1"], provider=sock, out=tmp_path)
    r = subprocess.run([*TB, "up", str(exp), "--detach"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    try:
        with pytest.raises(ValueError, match="start one beside 'testbed up'"):
            launch(script, ["1"], provider=sock, out=tmp_path)
        # a network of its own would wait for the one up to go: said at once instead
        with pytest.raises(ValueError, match="a network is up .* --provider"):
            launch(script, ["1"], hosts=2, algo="ring", out=tmp_path)
        # the provider `testbed provider serve --attach` runs, in this process: memory for
        # one INA job and no plans on the shared pool, so that a bigger job's arrival moves
        # the launched one to the ring (hints on trust: its claim ranks before any judgment)
        net = attach_up()
        svc = make_service(net, 70_000, policy="cooperative_static", net=net, probation=False)
        with Server(svc, socket_path=str(tmp_path / "p.sock")), ProviderClient(sock) as pc:
            with pytest.raises(ValueError, match="algo, time_dilation cannot be given"):
                launch(script, ["1"], provider=sock, algo="ring", time_dilation=2.0)
            pc.admit(JobRequest(job="hold", hosts=["tbh1", "tbh2"]))
            with pytest.raises(ValueError, match="refused job .*tbh1"):
                launch(script, ["1"], hosts=2, provider=sock, out=tmp_path)
            pc.release("hold")

            done = {}
            lines: list[str] = []
            a = threading.Thread(target=lambda: done.update(a=launch(
                script, ["60"], hosts=3, provider=sock, out=tmp_path / "a", echo=lines.append,
                hints={"tolerance": "exact", "collective_bytes": 200_000})))
            a.start()
            trace = str(tmp_path / "a" / "launch-*" / "trace0.jsonl")
            while _calls(trace) < 16 and a.is_alive():
                time.sleep(0.05)
            pc.admit(JobRequest(job="big", hosts=["tbh4", "tbh5", "tbh6"], lease_s=600,
                                hints=Hints(collective_bytes=2_000_000)))
            while _calls(trace) < 70 and a.is_alive():
                time.sleep(0.05)
            pc.release("big")
            a.join(300)
            # the job released at its end: no job left at the provider, none on the switch
            assert pc.jobs() == {} and _held() == set()
        svc.stop()
        net.close()

        run = done["a"]
        assert run.returncode == 0, run.failures
        assert sorted(x for x in lines if x.endswith((": ok", "]"))) == \
            [f"[{r}]:rank {r}: ok" for r in range(3)]
        meta = json.loads((run.folder / "launch.json").read_text())
        assert meta["plan_errors"] == [] and meta["provider"] == sock
        plans = meta["plans"]
        # INA on the provider's registration, the ring while the big job held the memory,
        # INA again under a new id once it left; each from the same call on every rank
        assert [p["algo"] for p in plans] == ["ina", "ring", "ina"], plans
        assert 1000 <= plans[0]["job_id"] < plans[2]["job_id"] <= 1999
        assert plans[1]["from_call"] < plans[2]["from_call"]
        assert [c["new"]["algo"] for c in meta["provider_log"]] == ["ina", "ring", "ina"]
        for row in run.trace:
            if row["op"] == "allreduce":
                assert row["path"] == f"testbed:{plans[row['plan']]['algo']}", row

        # the command line, with no bytes stated: derived from the first iterations, and the
        # provider re-plans the running job on them
        with Server(make_service(net := attach_up(), None, net=net),
                    socket_path=str(tmp_path / "p.sock")):
            r = subprocess.run([*TB, "launch", "--provider", sock, "--hosts", "3",
                                "--tolerance", "exact", "--out", str(tmp_path / "cli"),
                                str(script), "--", "25"], capture_output=True, text=True,
                               timeout=300)
        net.close()
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"the provider at {sock} planned ring" in r.stderr
        assert "re-planned while it ran: ina from collective" in r.stderr, r.stderr[-3000:]
        assert _held() == set()
    finally:
        subprocess.run([*TB, "down"], capture_output=True, timeout=300)
