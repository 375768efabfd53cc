"""``testbed demo``: the embedded default experiment, plus the Mininet smoke check.

:func:`main` (what ``testbed demo`` / ``make demo`` call) runs the real demo of
:mod:`testbed.experiment.demo`: a star of 4 workers with 100 Mb/s links around one
programmable switch, an 8 MB allreduce by ring, by in-network aggregation and with
compression, a table with the α-β model's predictions and a PNG plot.

The smoke experiment that stood here before stays available as :func:`smoke_main`: a star of
hosts ``tbh1..`` on one Linux bridge ``tbs1`` with 100 Mb/s HTB-shaped links: ping all
pairs, measure one link with iperf3 (TCP), print what was measured against what the links
were shaped to. It proves the machine can emulate networks faithfully. ``run_smoke`` returns
plain data and ``render`` prints it.
"""

from __future__ import annotations

import json
import os
import time

from mininet.log import setLogLevel
from rich.console import Console
from rich.table import Table

from testbed.cleanup import busy_holder, cleanup
from testbed.experiment.demo import main as experiment_demo
from testbed.netlock import EmulationBusy, emulation_lock
from testbed.topologies import Star
from testbed.topologies.net import TestbedNet

NOT_ROOT_HELP = (
    "testbed demo builds an emulated network and needs root: run 'sudo make demo' "
    "(or 'sudo .venv/bin/testbed demo'), or use the lab VM: 'vagrant up && vagrant ssh', "
    "then 'cd /vagrant && sudo make demo'."
)
TOLERANCE = 0.10  # measured bandwidth within ±10 % of the shaped rate (Mininet's own: ±20 %)


def _iperf3(client, server, seconds: float, port: int = 5201) -> float:
    """TCP goodput in Mb/s from ``client`` to ``server`` measured by iperf3 at the receiver."""
    srv = server.popen(["iperf3", "-s", "-1", "-p", str(port)])
    try:
        for _ in range(20):  # the server needs a moment to listen
            out = client.cmd(f"iperf3 -c {server.IP()} -p {port} -t {seconds:g} -J")
            try:
                report = json.loads(out)
            except json.JSONDecodeError:
                report = {"error": out.strip()[-200:]}
            if "error" not in report:
                return report["end"]["sum_received"]["bits_per_second"] / 1e6
            if "connect" not in report["error"]:
                raise RuntimeError(f"iperf3 failed: {report['error']}")
            time.sleep(0.2)
        raise RuntimeError(f"iperf3 could not reach {server.name}: {report['error']}")
    finally:
        srv.kill()
        srv.wait()


def run_smoke(n_hosts: int = 4, bw_mbps: float = 100.0, seconds: float = 3.0) -> dict:
    """Build the star, ping all pairs, measure tbh1 → tbh2 with iperf3, tear down.

    Needs root; the network holds the emulation lock (re-entrant: a caller may hold it).
    Returns ``{"hosts", "bw_mbps", "pings_sent", "pings_received", "rtt_avg_ms",
    "iperf_mbps", "ratio"}``.
    """
    if not 2 <= n_hosts <= 32:
        raise ValueError(f"n_hosts={n_hosts}: the smoke star needs 2..32 hosts")
    if bw_mbps <= 0:
        raise ValueError(f"bw_mbps={bw_mbps}: give a positive link rate in Mb/s")
    setLogLevel("error")  # Mininet prints every ping otherwise; render() shows the summary
    with TestbedNet(Star(n_hosts, bw_mbps=bw_mbps)) as net:
        pings = net.mininet.pingFull(timeout="2")
        sent = sum(r[2][0] for r in pings)
        received = sum(r[2][1] for r in pings)
        rtts = [r[2][3] for r in pings if r[2][1]]
        h1, h2 = net.hosts[:2]
        mbps = _iperf3(h1, h2, seconds)
    return {
        "hosts": n_hosts,
        "bw_mbps": bw_mbps,
        "pings_sent": sent,
        "pings_received": received,
        "rtt_avg_ms": sum(rtts) / len(rtts) if rtts else float("nan"),
        "iperf_mbps": mbps,
        "ratio": mbps / bw_mbps,
    }


def passed(result: dict) -> bool:
    """All pings answered and the shaped link measured within the tolerance."""
    return (result["pings_received"] == result["pings_sent"]
            and abs(result["ratio"] - 1) <= TOLERANCE)


def render(result: dict) -> None:
    """Print the measurements as a table."""
    def verdict(ok: bool) -> str:
        return "[green]ok[/green]" if ok else "[red]FAIL[/red]"

    n, sent, got = result["hosts"], result["pings_sent"], result["pings_received"]
    table = Table(title=f"testbed demo: star of {n} hosts on a Linux bridge, "
                        f"{result['bw_mbps']:g} Mb/s links")
    for col in ("measured", "value", "expected", "verdict"):
        table.add_column(col)
    table.add_row("ping, all pairs", f"{got}/{sent} answered ({100 * (1 - got / sent):.0f} % loss)",
                  "0 % loss", verdict(got == sent))
    table.add_row("ping RTT (avg)", f"{result['rtt_avg_ms']:.3f} ms", "no delay configured", "")
    table.add_row("iperf3 TCP tbh1 → tbh2", f"{result['iperf_mbps']:.1f} Mb/s "
                  f"({100 * result['ratio']:.0f} % of the shaped rate)",
                  f"{result['bw_mbps']:g} Mb/s ±{100 * TOLERANCE:.0f} %",
                  verdict(abs(result["ratio"] - 1) <= TOLERANCE))
    Console().print(table)


def main() -> int:
    """CLI entry: the embedded default experiment (testbed.experiment.demo); 0 when every run
    finished with a correct result."""
    return experiment_demo()


def smoke_main() -> int:
    """The Mininet smoke check under the emulation lock; 0 when everything passed."""
    err = Console(stderr=True)
    if os.geteuid() != 0:
        err.print(f"[red]{NOT_ROOT_HELP}[/red]")
        return 1

    holder = busy_holder()
    if holder:
        err.print(f"waiting for the emulation lock: another network is running ({holder})")
    try:
        with emulation_lock(timeout=120):
            # Holding the lock, anything of ours still around is from a dead run: clear it.
            stale = cleanup()
            if any(stale[k] for k in stale if k != "errors"):
                err.print(f"removed leftovers of an earlier run: {stale}")
            result = run_smoke()
    except EmulationBusy as exc:
        err.print(f"[red]testbed demo:[/red] {exc}")
        return 2
    except Exception as exc:  # a failed experiment is reported, not dumped as a traceback
        err.print(f"[red]testbed demo failed:[/red] {type(exc).__name__}: {exc}")
        return 1
    render(result)
    return 0 if passed(result) else 1
