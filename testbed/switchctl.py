"""``testbed switch NODE VERB``: talk to a running programmable node (switch or SmartNIC).

The client of the data-path engine's control channel (:class:`DatapathClient`, an abstract
Unix socket per node in the root network namespace: run it from there, not inside a host), for a network started with ``testbed up`` or any other
running one. The command-line counterpart of BMv2's ``simple_switch_CLI``:

* ``counters``: per-port packets/bytes/drops, drops by reason, every stage's counters, CPU;
* ``config``: the configuration the engine started with (ports, programs and settings);
* ``jobs``: the aggregation jobs registered on the node's ``aggregate`` stage, free slots;
* ``reset-job JOB``: free a job's slots after a worker died (other jobs are untouched);
* ``trace [--count N] [--timeout S]``: the next N frames through the node, decoded, with what
  the program did to each (egress port, flood, held in a queue, or the drop reason).

Each verb prints rich tables, or the engine's JSON answer with ``--json``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from testbed.datapath.control import ControlError, DatapathClient, control_address

VERBS = ("counters", "config", "jobs", "reset-job", "trace")


class SwitchError(RuntimeError):
    """The node cannot be reached or refused the command (the message says what to do)."""


def _running_nodes() -> list[str]:
    """Nodes whose engine listens on its control address in this network namespace."""
    prefix = control_address("")[:-len(".sock")]
    found = set()
    try:
        with open("/proc/net/unix") as fh:
            next(fh, None)
            for line in fh:
                fields = line.split()
                # Flags 00010000: a listening socket; the path column holds '@name' if abstract
                if len(fields) >= 8 and int(fields[3], 16) & 0x10000 and \
                        fields[7].startswith(prefix) and fields[7].endswith(".sock"):
                    found.add(fields[7][len(prefix):-len(".sock")])
    except OSError:
        pass
    return sorted(found)


def client(node: str) -> DatapathClient:
    """A connected client of ``node``; :class:`SwitchError` naming the running nodes if not."""
    c = DatapathClient(node, timeout=10.0)
    try:
        c.request("ping")
    except (ControlError, OSError) as e:
        c.close()
        nodes = _running_nodes()
        hint = (f"running nodes: {', '.join(nodes)}" if nodes else
                "no node is running: start a network with 'testbed up FILE'")
        raise SwitchError(f"cannot reach node {node!r} ({e}); {hint}") from None
    return c


def _request(node: str, fn) -> Any:
    with client(node) as c:
        try:
            return fn(c)
        except ControlError as e:
            raise SwitchError(f"{node}: {e}") from None


def _console() -> Console:
    con = Console()
    return con if con.is_terminal else Console(width=160)


def _flat(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(d, dict):
        out = []
        for k, v in d.items():
            out += _flat(v, f"{prefix}{k}.")
        return out
    return [(prefix[:-1], d)]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return escape(json.dumps(v) if isinstance(v, (list, dict)) else str(v))


def _reasons(d: dict) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in d.items()) or "-"


# -- verbs: each returns the engine's answer; render_* print it --------------------------------

def counters(node: str) -> dict:
    """All counters of ``node`` now."""
    return _request(node, lambda c: c.counters())


def render_counters(node: str, data: dict) -> None:
    """Ports, drops, stage counters and CPU of ``node`` as tables."""
    con = _console()
    ports = Table(title=f"{node}: ports")
    for col in ("port", "rx pkts", "rx bytes", "tx pkts", "tx bytes", "tx errors", "drops"):
        ports.add_column(col, justify="left" if col in ("port", "drops") else "right")
    for name, p in data.get("ports", {}).items():
        ports.add_row(name, *(_fmt(p.get(k, 0)) for k in ("rx_packets", "rx_bytes",
                                                            "tx_packets", "tx_bytes",
                                                            "tx_errors")),
                      _reasons(p.get("drops", {})))
    con.print(ports)
    stages = Table(title=f"{node}: stages")
    for col in ("stage", "counter", "value"):
        stages.add_column(col, justify="right" if col == "value" else "left")
    for stage, c in data.get("stages", {}).items():
        # per-port stage counters are summed in "totals" when the stage keeps them
        items = {k: v for k, v in c.items() if not (k == "ports" and "totals" in c)}
        items.pop("jobs", None)  # shown by the `jobs` verb
        for key, value in _flat(items):
            stages.add_row(stage, key, _fmt(value))
    con.print(stages)
    con.print(f"drops by reason: {_reasons(data.get('drops', {}))}; generated and dropped: "
              f"{_reasons(data.get('drops_generated', {}))}; stage errors: "
              f"{_reasons(data.get('stage_errors', {}))}")
    con.print(f"bursts {data.get('bursts', 0):,} (largest {data.get('max_burst', 0)} of "
              f"{data.get('rx_burst', '?')}); up {data.get('uptime_s', 0):.1f} s; CPU now "
              f"{data.get('cpu', 0):.0%}, max {data.get('cpu_max', 0):.0%}, average "
              f"{data.get('cpu_avg', 0):.0%}")


def config(node: str) -> dict:
    """The configuration ``node``'s engine started with."""
    return _request(node, lambda c: c.config())


def render_config(node: str, data: dict) -> None:
    """The engine's ports, options and program stages."""
    con = _console()
    con.print(f"[bold]{node}[/]: ports {', '.join(data.get('ports', []))}")
    for key in ("rx_burst", "coalesce_us", "flood_ports", "control_socket"):
        if key in data:
            con.print(f"  {key}: {_fmt(data[key])}")
    table = Table(title=f"{node}: program (stages in order)")
    for col in ("#", "stage", "settings"):
        table.add_column(col)
    for i, prog in enumerate(data.get("programs") or []):
        name, settings = (prog, {}) if isinstance(prog, str) else (
            (prog.get("name"), prog.get("settings", {})) if isinstance(prog, dict) else prog)
        text = _fmt(settings or {})
        if len(text) > 300:  # forwarding tables can be long
            text = text[:300] + " … (--json shows all)"
        table.add_row(str(i), escape(str(name)), text)
    con.print(table)


def jobs(node: str) -> dict:
    """``{"jobs": {job_id: {...}}, "free_slots": n}`` of ``node``'s aggregate stage."""
    data = counters(node)
    agg = data.get("stages", {}).get("aggregate")
    if agg is None:
        raise SwitchError(f"{node} runs no aggregate stage (stages: "
                          f"{', '.join(data.get('stages', {})) or 'none'}); jobs live on the "
                          "aggregator switch ('testbed up' prints which)")
    return {"jobs": agg.get("jobs", {}), "free_slots": agg.get("free_slots")}


def render_jobs(node: str, data: dict) -> None:
    """One row per registered job."""
    con = _console()
    table = Table(title=f"{node}: aggregation jobs")
    for col in ("job", "workers", "slots", "first slot"):
        table.add_column(col, justify="right")
    for jid, j in sorted(data["jobs"].items(), key=lambda kv: int(kv[0])):
        table.add_row(str(jid), _fmt(j.get("n_workers")), _fmt(j.get("slots")),
                      _fmt(j.get("base")))
    con.print(table)
    if not data["jobs"]:
        con.print("no job registered (a collective registers its job while it runs)")
    con.print(f"free slots: {_fmt(data.get('free_slots'))}")


def reset_job(node: str, job_id: int) -> dict:
    """Free ``job_id``'s slots on ``node`` (its partition starts again from chunk 0)."""
    _request(node, lambda c: c.reset_job(job_id))
    return {"node": node, "job": job_id, "reset": True}


def trace(node: str, count: int = 20, timeout: float = 10.0) -> dict:
    """The next ``count`` frames through ``node`` (fewer if ``timeout`` s pass first)."""
    with client(node) as c:
        try:
            c.trace(count)
            records: list[dict] = []
            deadline = time.monotonic() + timeout
            remaining = count
            while remaining and time.monotonic() < deadline:
                time.sleep(0.1)
                got = c.trace()
                records += got["records"]
                remaining = got["remaining"]
            if remaining:
                c.trace(0)  # disarm: nobody reads the rest
        except ControlError as e:
            raise SwitchError(f"{node}: {e}") from None
    return {"node": node, "asked": count, "records": records, "timed_out": bool(remaining)}


def render_trace(node: str, data: dict) -> None:
    """One row per frame: time, ports, decision, addresses, testbed header fields."""
    con = _console()
    table = Table(title=f"{node}: {len(data['records'])} frames")
    for col in ("t ms", "in", "out", "len", "proto", "source", "destination", "testbed header"):
        table.add_column(col, justify="right" if col in ("t ms", "len") else "left")
    for r in data["records"]:
        src = r.get("ip_src", r.get("eth_src", ""))
        dst = r.get("ip_dst", r.get("eth_dst", ""))
        if "sport" in r:
            src, dst = f"{src}:{r['sport']}", f"{dst}:{r['dport']}"
        header = ""
        if r.get("proto") == "testbed":
            header = (f"{r['msg_type']} job {r['job_id']} worker {r['worker_id']} slot "
                      f"{r['slot']}/{r['slot_set']} off {r['chunk_offset']} "
                      f"{r['elem_count']}x{r['codec']} {r['flags']}")
        table.add_row(f"{r['t_ms']:.3f}", r["in"], r["out"], str(r["len"]),
                      r.get("proto", r.get("ethertype", "")), src, dst, header)
    con.print(table)
    if data["timed_out"]:
        con.print(f"only {len(data['records'])} of {data['asked']} frames passed within the "
                  "timeout")
