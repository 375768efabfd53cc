"""``testbed provider serve|status|jobs|plan``: run the fabric manager, and ask it questions.

* ``serve FILE``: build the network of an experiment file (its topology, programs) and run
  the fabric manager service over it until Ctrl-C or SIGTERM: telemetry from every engine,
  leases, switch configuration. ``--no-network`` serves plans for the file's topology without
  building it (no telemetry, no switches): enough to try policies and clients. ``--attach``
  serves the network ``testbed up`` runs instead (the provider is then a process of its own:
  stopped or killed, it leaves the network and the jobs running); ``--journal PATH`` keeps
  the state in SQLite and resumes from it on the next start.
* ``status``, ``jobs``, ``plan [JOB] [--policy P]``: the service's health, memory and
  telemetry; the admitted jobs with their leases and plans; one job's plan or a dry run of
  another policy. Tables, or the JSON answers with ``--json``.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from typing import Any

from rich.console import Console
from rich.table import Table

from testbed.provider.client import ProviderClient, ProviderRefused, ProviderUnreachable
from testbed.provider.service import (
    DEFAULT_SOCKET,
    DEFAULT_TELEMETRY_PERIOD_S,
    Server,
    make_service,
)


class CtlError(RuntimeError):
    """What the command line reports in one line (exit status 1)."""


def _console() -> Console:
    con = Console(stderr=False)
    return con if con.is_terminal else Console(width=160)


def default_memory_bytes() -> int:
    """Static aggregator memory of a switch built with the data path's defaults (its memory
    minus the shared pool's share)."""
    # Function-level import: the aggregate stage loads the aggregation kernels (Numba).
    from testbed.datapath.aggregate import DEFAULT_MEMORY_BYTES, POOL_SHARE

    return DEFAULT_MEMORY_BYTES - DEFAULT_MEMORY_BYTES // POOL_SHARE


def serve(file: str | None, point: int = 0, policy: str = "cooperative",
          memory_bytes: int | None = None, socket_path: str | None = DEFAULT_SOCKET,
          port: int | None = None, telemetry_period_s: float = DEFAULT_TELEMETRY_PERIOD_S,
          network: bool = True, attach: bool = False, journal: str | None = None,
          quotas: str | None = None, trust_hints: bool = False) -> int:
    """CLI entry of ``serve``: 0 after a clean stop, 2 for a bad file or option, 1 when the
    network or the service cannot start, 130 on Ctrl-C."""
    # Function-level imports: the experiment runner loads Mininet and the data path.
    from testbed.experiment.networks import attach_up, network_for, running_up, topology_for
    from testbed.experiment.spec import load_point
    from testbed.provider.journal import JournalError

    try:
        if attach:
            file, point, _state = running_up(file)
        elif file is None:
            raise ValueError("give the experiment FILE whose network to serve, or --attach to "
                             "serve the network 'testbed up' runs")
        _exp, pt = load_point(file, point)
        topo = topology_for(pt)
        tenant_quotas = load_quotas(quotas) if quotas is not None else None
        # validates the policy and memory before a network is built
        make_service(topo, default_memory_bytes() if memory_bytes is None else memory_bytes,
                     policy, quotas=tenant_quotas)
    except ValueError as e:
        print(f"testbed provider serve: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_term(_sig, _frm):
        stop.set()

    old = signal.signal(signal.SIGTERM, on_term)
    kw = {"telemetry_period_s": telemetry_period_s, "journal": journal,
          "quotas": tenant_quotas, "probation": False if trust_hints else None}
    try:
        if attach:
            net = attach_up(file)
            try:
                svc = make_service(net, memory_bytes, policy, net=net, **kw)
                return _serve_until(svc, socket_path, port, stop)
            finally:
                net.close()
        if not network:
            mem = default_memory_bytes() if memory_bytes is None else memory_bytes
            return _serve_until(make_service(topo, mem, policy, **kw), socket_path, port, stop)
        with network_for(pt) as net:
            svc = make_service(net, memory_bytes, policy, net=net, **kw)
            pids = {h.name: h.pid for h in net.hosts}
            print(f"network up: hosts {pids} (run tenant code with 'mnexec -a PID CMD')",
                  file=sys.stderr)
            return _serve_until(svc, socket_path, port, stop)
    except KeyboardInterrupt:
        return 130
    except (JournalError, ValueError) as e:
        print(f"testbed provider serve: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:
        print(f"testbed provider serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)


def load_quotas(path: str) -> dict:
    """Per-tenant quotas from a TOML or JSON file: one table per tenant (``"*"``: every other
    tenant) with ``jobs``, ``priority``, ``memory_bytes``, ``trees_per_switch``;
    ``ValueError`` naming the tenant and the problem."""
    import tomllib
    from pathlib import Path

    from testbed.provider.manager import Quota

    try:
        text = Path(path).read_text()
        data = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (OSError, ValueError) as e:
        raise ValueError(f"--quotas {path}: {e}") from None
    out = {}
    for tenant, q in data.items():
        if not isinstance(q, dict):
            raise ValueError(f"--quotas {path}: tenant {tenant!r} needs a table of limits")
        try:
            out[tenant] = Quota(**q)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--quotas {path}: tenant {tenant!r}: {e}") from None
    return out


def _serve_until(svc, socket_path: str | None, port: int | None, stop: threading.Event) -> int:
    with Server(svc, socket_path=socket_path, port=port) as srv:
        print(f"provider: policy {svc.manager.policy.name}, serving at {srv.url} "
              "(Ctrl-C stops)", file=sys.stderr)
        if svc.resumed is not None:
            print(f"provider: resumed from {svc.journal.path}: {json.dumps(svc.resumed)}",
                  file=sys.stderr)
        while not stop.wait(0.5):
            pass
    return 0


def ask(address: str | None, fn) -> Any:
    """``fn(client)``, with the client's failures as :class:`CtlError`."""
    try:
        with ProviderClient(address) as pc:
            return fn(pc)
    except (ProviderRefused, ProviderUnreachable) as e:
        raise CtlError(str(e)) from None


def status(address: str | None) -> dict:
    """Health, memory and the latest telemetry of the service."""
    return ask(address, lambda pc: {"health": pc.health(), "memory": pc.memory(),
                                    "telemetry": pc.telemetry_raw()})


def render_status(data: dict) -> None:
    """Health line, switch memory table, busiest links."""
    con = _console()
    h = data["health"]
    con.print(f"policy [bold]{h['policy']}[/], {h['jobs']} job(s); telemetry "
              f"{'on' if h['telemetry'] else 'off'}; configures switches: "
              f"{'yes' if h['configures_switches'] else 'no'}"
              + (f"; last background error: {h['background_error']}"
                 if h.get("background_error") else ""))
    mem = Table(title="aggregator memory (bytes)")
    for col in ("switch", "configured", "free", "allocated per job"):
        mem.add_column(col, justify="left" if col in ("switch", "allocated per job") else "right")
    for sw, m in sorted(data["memory"].items()):
        if m["configured"]:
            mem.add_row(sw, f"{m['configured']:,}", f"{m['free']:,}",
                        ", ".join(f"{j} {b:,}" for j, b in m["allocated"].items()) or "-")
    con.print(mem)
    links = sorted(data["telemetry"]["snapshot"]["links"], key=lambda lk: -lk["utilisation"])
    busy = [lk for lk in links if lk["utilisation"] or lk["drops"] or lk["trims"]][:10]
    if busy:
        table = Table(title="busiest links")
        for col in ("link", "Mb/s", "utilisation", "queue B", "drops", "trims"):
            table.add_column(col, justify="left" if col == "link" else "right")
        for lk in busy:
            table.add_row(f"{lk['src']} -> {lk['dst']}", f"{lk['rate_mbps']:g}",
                          f"{lk['utilisation']:.0%}", f"{lk['queue_bytes']:,}",
                          f"{lk['drops']:,}", f"{lk['trims']:,}")
        con.print(table)
    for node, err in data["telemetry"].get("errors", {}).items():
        con.print(f"[red]telemetry: {node}: {err}[/]")


def jobs(address: str | None) -> dict:
    """The admitted jobs."""
    return ask(address, lambda pc: pc.jobs())


def _plan_text(p: dict | None) -> str:
    if not p:
        return "-"
    parts = [p["algo"]]
    if p.get("tree"):
        parts.append(f"tree {p['tree']}")
    if p.get("slots"):
        parts.append(f"{p['slots']} slots {p.get('mode', 'static')}")
    if p.get("compressor"):
        parts.append(f"{p['compressor']} {p.get('compressor_params') or ''}".strip())
    if p.get("error_feedback"):
        parts.append("error feedback")
    if p.get("trim_head_bits"):
        parts.append(f"trim {p['trim_head_bits']} head bits")
    if p.get("transport", "tcp") != "tcp":  # a UET ring: its ports trim while it runs
        parts.append(f"over {p['transport']}, ports trimming")
    return ", ".join(parts)


def render_jobs(data: dict) -> None:
    """One row per job: hosts, lease left, plan, predicted time."""
    con = _console()
    table = Table(title="admitted jobs")
    for col in ("job", "hosts", "lease left s", "plan", "predicted comm s"):
        table.add_column(col, justify="right" if col.endswith(" s") else "left")
    for name, j in sorted(data.items()):
        p = j.get("plan") or {}
        pred = p.get("predicted_comm_s")
        table.add_row(name, ", ".join(j["hosts"]), f"{j['expires_in_s']:.1f}", _plan_text(p),
                      "-" if pred is None else f"{pred:.4g}")
    con.print(table)
    if not data:
        con.print("no job admitted")


def plan(address: str | None, job: str | None, policy: str | None) -> dict:
    """``job``'s plan, or with ``policy`` the dry run of that policy for every job."""
    if policy is not None:
        return ask(address, lambda pc: {"policy": policy, "plans": {
            k: p.model_dump() for k, p in pc.dry_run(policy).items()}})
    if job is None:
        raise CtlError("name a JOB, or give --policy P for a dry run over all jobs")
    return ask(address, lambda pc: {"plans": {job: pc.plan(job).model_dump()}})


def render_plan(data: dict) -> None:
    """One row per plan, with its reason."""
    con = _console()
    title = f"dry run of policy {data['policy']}" if "policy" in data else "current plan"
    table = Table(title=title)
    for col in ("job", "plan", "predicted comm s", "reason"):
        table.add_column(col)
    for name, p in sorted(data["plans"].items()):
        pred = p.get("predicted_comm_s")
        table.add_row(name, _plan_text(p), "-" if pred is None else f"{pred:.4g}",
                      p.get("reason", ""))
    con.print(table)


def dump(data: Any) -> None:
    """The JSON form of an answer."""
    print(json.dumps(data, indent=1))
