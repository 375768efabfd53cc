"""The ``testbed`` command line.

Each subcommand lives in the module that owns it and is imported only when used, so
``testbed --help`` stays fast (no numba, no mininet import).
"""

from __future__ import annotations

import json
import os
import sys

import typer

app = typer.Typer(
    help="Emulation testbed for offloading AI collectives to the network.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks: print ratios against anchors measured in the same run.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
switch_app = typer.Typer(
    help="Talk to a running programmable node (switch or SmartNIC) over its control socket: "
         "testbed switch NODE counters|config|jobs|reset-job JOB|trace [--json].",
    no_args_is_help=True)
app.add_typer(switch_app, name="switch")
provider_app = typer.Typer(
    help="The fabric manager: serve it over a network, or ask it about jobs, plans and "
         "telemetry: testbed provider serve FILE | status | jobs | plan [JOB] [--policy P].",
    no_args_is_help=True)
app.add_typer(provider_app, name="provider")

OUT_HELP = ("results root: a folder <name>-<time>/ is created in it (default: $TESTBED_RESULTS, "
            "else results/ of the checkout, else ~/testbed-results)")
BENCH_OUT_HELP = ("also store the rows (jsonl, csv, parquet), metadata and a plot in "
                  "DIR/bench-<name>-<time>/")
DILATION_HELP = ("run the network F times slower (links at bw/F, delays and timeouts times F) "
                 "and report undilated times; 'auto' calibrates the smallest F that keeps the "
                 "CPU unsaturated")


def _dilation(text: str | None) -> float | str | None:
    """``--time-dilation`` as the experiment takes it: a number, 'auto', or None (not given);
    a bad value is left for the experiment's validation to explain."""
    if text is None or text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        return text


@app.command()
def doctor(json_out: bool = typer.Option(False, "--json", help="print the checks as JSON"),
           servers: str = typer.Option("", "--servers", metavar="A,B",
                                       help="also check these cluster servers over ssh "
                                            "(docs/cluster.md)")) -> None:
    """Check what the testbed needs against what this machine offers."""
    from testbed.doctor import main

    raise typer.Exit(main(json_out=json_out,
                          servers=[s for s in servers.split(",") if s.strip()]))


@app.command()
def cleanup(
    force: bool = typer.Option(False, "--force", help="do not wait for a running network's lock"),
    servers: str = typer.Option("", "--servers", metavar="A,B",
                                help="clean these cluster servers over ssh too (docs/cluster.md)"),
) -> None:
    """Remove only what the testbed created (namespaces, links, processes, bridges)."""
    from testbed.cleanup import main

    raise typer.Exit(main(force=force, servers=[s for s in servers.split(",") if s.strip()]))


@app.command()
def warm(quiet: bool = typer.Option(False, "--quiet", help="print only failures and the total")
         ) -> None:
    """Compile every Numba kernel now (1-3 CPU-minutes on a fresh checkout), so no run pays it."""
    from testbed.warm import main

    raise typer.Exit(main(["--quiet"] if quiet else []))


@app.command()
def lab(
    port: int = typer.Option(8888, help="port JupyterLab listens on"),
    ip: str = typer.Option("0.0.0.0", help="address to listen on (0.0.0.0 for the lab VM)"),
) -> None:
    """Start JupyterLab on notebooks/ (with the flags running as root needs)."""
    from testbed.lab import main

    raise typer.Exit(main(port=port, ip=ip))


@app.command()
def wireshark() -> None:
    """Print a Wireshark Lua dissector for the testbed header (generated from the wire table):
    testbed wireshark > testbed.lua; wireshark -X lua_script:testbed.lua capture.pcap"""
    from testbed.wireshark import main

    raise typer.Exit(main())


@app.command()
def demo(out: str = typer.Option(None, help=OUT_HELP),
         time_dilation: str = typer.Option("1", "--time-dilation", metavar="F|auto",
                                           help=DILATION_HELP)) -> None:
    """Run the embedded default experiment and print what it measured."""
    from testbed.experiment.demo import main
    from testbed.experiment.plots import use_headless
    from testbed.experiment.results import results_root

    use_headless()
    raise typer.Exit(main(out=results_root() if out is None else out,
                          time_dilation=_dilation(time_dilation)))


@app.command()
def run(
    file: str = typer.Argument(..., help="experiment file (TOML or YAML)"),
    out: str = typer.Option(None, help=OUT_HELP),
    time_dilation: str = typer.Option(None, "--time-dilation", metavar="F|auto",
                                      help=DILATION_HELP + " (default: the file's)"),
    json_out: bool = typer.Option(False, "--json", help="print the summary rows as JSON lines "
                                  "on stdout (tables and messages go to stderr)"),
    executor: str = typer.Option(None, "--executor", metavar="local|dask",
                                 help="where the sweep points run: here (local, the default) "
                                      "or on the workers of a Dask cluster (dask; the default "
                                      "when --scheduler is given)"),
    scheduler: str = typer.Option(None, "--scheduler", metavar="tcp://HOST:8786",
                                  help="the Dask scheduler's address, for --executor dask"),
) -> None:
    """Run an experiment file and write its results (exit: 0 ok, 1 failed runs, 2 bad file)."""
    from testbed.experiment.cli import run_file

    raise typer.Exit(run_file(file, out, time_dilation=_dilation(time_dilation),
                              json_out=json_out, executor=executor, scheduler=scheduler))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    script: str = typer.Argument(..., help="the PyTorch script every rank runs, unmodified"),
    args: list[str] = typer.Argument(None, help="the script's own arguments (after --)"),
    hosts: int = typer.Option(None, "--hosts", min=1, help="ranks: one on each of the first N "
                              "hosts (default: every host; a star of 2 without --experiment)"),
    experiment: str = typer.Option(None, "--experiment", "-e",
                                   help="an experiment file whose network to use"),
    algo: str = typer.Option(None, "--algo", help="the testbed algorithm the script's float32 "
                             "allreduces take (ring, hd, ina, nic, a plug-in; default: plain "
                             "gloo, the baseline)"),
    compressor: str = typer.Option(None, "--compressor", help="with --algo: compress them"),
    error_feedback: bool = typer.Option(False, "--error-feedback"),
    bw_mbps: float = typer.Option(None, "--bw-mbps", help="link rate of the default star"),
    time_dilation: str = typer.Option(None, "--time-dilation", metavar="F|auto",
                                      help=DILATION_HELP),
    timeout: float = typer.Option(600.0, "--timeout", help="seconds before the job is stopped"),
    out: str = typer.Option(None, help=OUT_HELP),
) -> None:
    """Run a PyTorch script on the emulated hosts, torchrun-style (exit: the worst rank's)."""
    from testbed.launch import launch as run_script

    try:
        done = run_script(script, args or [], hosts=hosts, experiment=experiment, algo=algo,
                          compressor=compressor, error_feedback=error_feedback,
                          topology={"bw_mbps": bw_mbps} if bw_mbps else None,
                          time_dilation=_dilation(time_dilation), timeout_s=timeout, out=out)
    except ValueError as e:
        print(f"testbed launch: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    for line in done.failures:
        print(f"testbed launch: {line}", file=sys.stderr)
    paths: dict[str, int] = {}
    for row in done.trace:
        paths[row["path"]] = paths.get(row["path"], 0) + 1
    ok = sum(1 for c in done.returncodes if c == 0)
    stopped = len(done.returncodes) - ok - len(done.failed_ranks)
    print(f"testbed launch: {ok}/{len(done.returncodes)} ranks succeeded"
          f"{f', {stopped} stopped' if stopped > 0 else ''}; collectives: "
          f"{', '.join(f'{k} {v}' for k, v in sorted(paths.items())) or 'not traced (gloo)'}; "
          f"results: {done.folder}", file=sys.stderr)
    raise typer.Exit(done.returncode)


@app.command()
def replay(
    prefix: str = typer.Argument(..., help="the trace: files PREFIX.0.et, PREFIX.1.et, ..."),
    experiment: str = typer.Option(None, "--experiment", "-e",
                                   help="an experiment file whose network to use (default: a "
                                        "star with a host per rank at 100 Mb/s)"),
    algo: str = typer.Option(None, "--algo", help="the testbed algorithm of its float32 "
                             "allreduces (ring, hd, ina, nic, a plug-in; default: gloo)"),
    bw_mbps: float = typer.Option(None, "--bw-mbps", help="link rate of the default star"),
    scale: float = typer.Option(1.0, "--scale", help="factor on the compute durations"),
    time_dilation: str = typer.Option(None, "--time-dilation", metavar="F|auto",
                                      help=DILATION_HELP),
    timeout: float = typer.Option(600.0, "--timeout", help="seconds before it is stopped"),
    json_out: bool = typer.Option(False, "--json", help="print the validation rows as JSON"),
    out: str = typer.Option(None, help=OUT_HELP),
) -> None:
    """Replay a Chakra execution trace on the emulated fabric and validate it against the
    flow model (exit: 0 ok, 1 a rank failed, 2 a trace that cannot be replayed)."""
    from testbed.experiment.bench_results import print_rows
    from testbed.replay import TraceError
    from testbed.replay import replay as run_trace

    try:
        res = run_trace(prefix, experiment=experiment, algo=algo, scale=scale,
                        topology={"bw_mbps": bw_mbps} if bw_mbps else None,
                        time_dilation=_dilation(time_dilation), timeout_s=timeout, out=out,
                        echo=lambda line: None)
    except (TraceError, ValueError) as e:
        print(f"testbed replay: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    for line in res.launched.failures:
        print(f"testbed replay: {line}", file=sys.stderr)
    if json_out:
        for row in res.validation:
            print(json.dumps(row, default=str))
    else:
        print_rows(res.validation, f"replay of {prefix}: measured vs flow model",
                   ("op", "bytes", "path", "count", "measured_s", "predicted_s", "error_pct"))
    geo = "n/a" if res.geomean_error_pct is None else f"{res.geomean_error_pct:.1f} %"
    print(f"testbed replay: JCT {res.jct_s:.4g} s, {len(res.collectives)} collectives, "
          f"geomean error {geo}; results: {res.folder}", file=sys.stderr)
    raise typer.Exit(1 if res.launched.returncode else 0)


@app.command()
def up(
    file: str = typer.Argument(..., help="experiment file whose topology to build"),
    point: int = typer.Option(0, help="which sweep point's network (0-based)"),
    cli: bool = typer.Option(None, "--cli/--no-cli",
                             help="Mininet's CLI (default: when stdin is a terminal)"),
    detach: bool = typer.Option(False, "--detach",
                                help="run in the background; return once the network is up"),
) -> None:
    """Build an experiment's network and keep it running until 'testbed down'."""
    from testbed.up import up as start

    raise typer.Exit(start(file, point=point, cli=cli, detach=detach))


@app.command()
def down(timeout: float = typer.Option(120.0, help="seconds to wait for the teardown")) -> None:
    """Tear down the network 'testbed up' keeps running."""
    from testbed.up import down as stop

    raise typer.Exit(stop(timeout=timeout))


# -- testbed switch NODE VERB ---------------------------------------------------------------------

@switch_app.callback()
def switch(ctx: typer.Context,
           node: str = typer.Argument(..., help="node name, e.g. tbs1 (switch) or tbn1 (NIC)")
           ) -> None:
    """Talk to a running programmable node over its control socket."""
    ctx.obj = node


def _switch_verb(ctx: typer.Context, verb: str, json_out: bool, *args, **kw) -> None:
    from testbed import switchctl

    node = ctx.obj
    try:
        data = getattr(switchctl, verb.replace("-", "_"))(node, *args, **kw)
    except switchctl.SwitchError as e:
        print(f"testbed switch: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    if json_out:
        print(json.dumps(data, indent=1))
    elif verb == "reset-job":
        print(f"{node}: job {data['job']} reset (its slots are free)")
    else:
        getattr(switchctl, f"render_{verb}")(node, data)


JSON_OPT = typer.Option(False, "--json", help="print the engine's answer as JSON")


@switch_app.command("counters")
def switch_counters(ctx: typer.Context, json_out: bool = JSON_OPT) -> None:
    """Ports, drops by reason, every stage's counters, CPU."""
    _switch_verb(ctx, "counters", json_out)


@switch_app.command("config")
def switch_config(ctx: typer.Context, json_out: bool = JSON_OPT) -> None:
    """The configuration the engine started with: ports, program stages and settings."""
    _switch_verb(ctx, "config", json_out)


@switch_app.command("jobs")
def switch_jobs(ctx: typer.Context, json_out: bool = JSON_OPT) -> None:
    """Aggregation jobs registered on the node (and free slots)."""
    _switch_verb(ctx, "jobs", json_out)


@switch_app.command("reset-job")
def switch_reset_job(ctx: typer.Context, job: int = typer.Argument(..., help="job id"),
                     json_out: bool = JSON_OPT) -> None:
    """Free a job's aggregation slots (after a worker died); other jobs are untouched."""
    _switch_verb(ctx, "reset-job", json_out, job)


@switch_app.command("trace")
def switch_trace(ctx: typer.Context,
                 count: int = typer.Option(20, help="frames to record (1..10000)"),
                 timeout: float = typer.Option(10.0, help="give up waiting after this many s"),
                 json_out: bool = JSON_OPT) -> None:
    """The next frames through the node, decoded, with what the program did to each."""
    _switch_verb(ctx, "trace", json_out, count=count, timeout=timeout)


# -- testbed provider serve|status|jobs|plan ------------------------------------------------------

ADDRESS_OPT = typer.Option(None, "--address", help="the service: unix:PATH or http://HOST:PORT "
                           "(default $TESTBED_PROVIDER, else unix:/run/testbed/provider.sock)")


@provider_app.command("serve")
def provider_serve(
    file: str = typer.Argument(..., help="experiment file whose topology (and programs) to serve"),
    point: int = typer.Option(0, help="which sweep point's network (0-based)"),
    policy: str = typer.Option("cooperative", help="tenant_only, provider_only, cooperative "
                               "or oracle"),
    memory_bytes: int = typer.Option(None, help="static aggregator memory per programmable "
                                     "switch (default: what the switches' engines report; without a "
                                     "network, the data path's default)"),
    socket: str = typer.Option(None, help="Unix socket to serve on (default "
                               "/run/testbed/provider.sock)"),
    port: int = typer.Option(None, help="serve on TCP 127.0.0.1:PORT instead of a socket"),
    telemetry_period: float = typer.Option(1.0, help="seconds between telemetry collections"),
    network: bool = typer.Option(True, "--network/--no-network",
                                 help="build the network (telemetry, switches) or only plan"),
) -> None:
    """Build the file's network and run the fabric manager on it until Ctrl-C."""
    from testbed.provider import ctl
    from testbed.provider.service import DEFAULT_SOCKET

    raise typer.Exit(ctl.serve(file, point=point, policy=policy, memory_bytes=memory_bytes,
                               socket_path=socket or DEFAULT_SOCKET, port=port,
                               telemetry_period_s=telemetry_period, network=network))


def _provider_verb(verb: str, json_out: bool, *args) -> None:
    from testbed.provider import ctl

    try:
        data = getattr(ctl, verb)(*args)
    except ctl.CtlError as e:
        print(f"testbed provider {verb}: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    if json_out:
        ctl.dump(data)
    else:
        getattr(ctl, f"render_{verb}")(data)


PJSON_OPT = typer.Option(False, "--json", help="print the service's answer as JSON")


@provider_app.command("status")
def provider_status(address: str = ADDRESS_OPT, json_out: bool = PJSON_OPT) -> None:
    """Policy, switch memory, busiest links and telemetry errors."""
    _provider_verb("status", json_out, address)


@provider_app.command("jobs")
def provider_jobs(address: str = ADDRESS_OPT, json_out: bool = PJSON_OPT) -> None:
    """Admitted jobs: hosts, lease left, plan, predicted communication time."""
    _provider_verb("jobs", json_out, address)


@provider_app.command("plan")
def provider_plan(job: str = typer.Argument(None, help="the job whose plan to show"),
                  policy: str = typer.Option(None, help="dry run: the plans this policy would "
                                             "give every admitted job now"),
                  address: str = ADDRESS_OPT, json_out: bool = PJSON_OPT) -> None:
    """A job's current plan, or a dry run of another policy."""
    _provider_verb("plan", json_out, address, job, policy)


# -- benchmarks -----------------------------------------------------------------------------------

def _stored(name: str, out: str, json_out: bool, rows: list[dict], notes: dict,
            columns: tuple[str, ...] | None = None) -> None:
    """Store a benchmark's rows under ``out`` and print them (table or JSON)."""
    from testbed.experiment.bench_results import print_rows, save_bench

    folder = save_bench(name, rows, out, notes)
    if json_out:
        print(json.dumps({"rows": rows, "notes": notes}, default=str))
    else:
        print_rows(rows, f"testbed bench {name}", columns)
    print(f"results: {folder}", file=sys.stderr if json_out else sys.stdout)


#: ``bench kernels --quick``: a gradient small enough for seconds, not minutes
QUICK_ELEMENTS = 1_000_000
QUICK_HELP = "small sizes and short trials: seconds to a minute, for a check that it runs"


def _bench_kernels(json_out: bool, elements: int, out: str | None, only: str = "") -> int:
    groups = tuple(g.strip() for g in only.split(",") if g.strip()) or None
    if out is None:
        from testbed.kernels.bench import main

        return main(json_out=json_out, elements=elements, only=groups)
    from testbed.kernels.bench import rows

    notes = {"elements": elements} | ({"only": list(groups)} if groups else {})
    _stored("kernels", out, json_out, rows(elements, groups), notes)
    return 0


def _bench_datapath(json_out: bool, out: str | None, quick: bool = False) -> int:
    from testbed.experiment import datapath_bench as bench

    if out is None:
        return bench.main(json_out=json_out, quick=quick)
    if os.geteuid() != 0:
        print("testbed bench datapath needs root (it builds Mininet networks)", file=sys.stderr)
        return 2
    rows, notes = bench.run_bench(**(bench.QUICK if quick else {}))
    _stored("datapath", out, json_out, rows, notes | {"quick": quick})
    return 0


def _bench_collectives(json_out: bool, out: str | None, quick: bool = False) -> int:
    from testbed.experiment import collectives_bench as bench

    quick = quick or os.environ.get("TESTBED_BENCH_QUICK", "") not in ("", "0")
    if out is None:
        return bench.main(json_out=json_out, quick=quick)
    rows = bench.run(quick=quick, reps=int(os.environ.get("TESTBED_BENCH_REPS", "1")))
    targets = {k: {"met": m, "detail": d} for k, (m, d) in bench.targets(rows).items()}
    _stored("collectives", out, json_out, rows, {"quick": quick, "targets": targets},
            bench.SHOW)
    return 0 if rows and all(r["correct"] for r in rows) else 1


@bench_app.command("kernels")
def bench_kernels(
    json_out: bool = typer.Option(False, "--json"),
    elements: int = typer.Option(25_000_000, help="gradient length (float32 elements)"),
    out: str = typer.Option(None, metavar="DIR", help=BENCH_OUT_HELP),
    only: str = typer.Option("", "--only", metavar="G,H",
                             help="only these row groups: elementwise, trimming, packets, "
                                  "compressors"),
    quick: bool = typer.Option(False, "--quick", help=f"{QUICK_ELEMENTS:,} elements"),
) -> None:
    """Numba kernels against numpy anchors (GB/s)."""
    try:
        code = _bench_kernels(json_out, QUICK_ELEMENTS if quick else elements, out, only)
    except ValueError as e:  # a bad --only or --elements: say so without a traceback
        print(f"testbed bench kernels: {e}", file=sys.stderr)
        code = 2
    raise typer.Exit(code)


@bench_app.command("datapath")
def bench_datapath(json_out: bool = typer.Option(False, "--json"),
                   out: str = typer.Option(None, metavar="DIR", help=BENCH_OUT_HELP),
                   quick: bool = typer.Option(False, "--quick", help=QUICK_HELP)) -> None:
    """Data path programs against Linux bridge, OVS userspace and a Python forwarder (kpps)."""
    raise typer.Exit(_bench_datapath(json_out, out, quick))


@bench_app.command("collectives")
def bench_collectives(json_out: bool = typer.Option(False, "--json"),
                      out: str = typer.Option(None, metavar="DIR", help=BENCH_OUT_HELP),
                      quick: bool = typer.Option(False, "--quick", help="4 workers, 1 MiB")
                      ) -> None:
    """Allreduce algorithms on a star against the alpha-beta model."""
    raise typer.Exit(_bench_collectives(json_out, out, quick))


@bench_app.command("reliability")
def bench_reliability(
    quick: bool = typer.Option(False, "--quick", help="each impairment alone at its worst, "
                               "all combined, 1 MiB (about 8 minutes)"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """In-network aggregation under loss, duplication, reordering, strangers and a dead
    switch (every row checked against numpy)."""
    from testbed.experiment.reliability import main

    raise typer.Exit(main(quick=quick, json_out=json_out))


@bench_app.command("tenancy")
def bench_tenancy(
    quick: bool = typer.Option(False, "--quick", help="4 MiB on the fat-tree, 1 MiB per "
                               "tenant (a few minutes)"),
    json_out: bool = typer.Option(False, "--json"),
    time_dilation: str = typer.Option(None, "--time-dilation", metavar="F|auto",
                                      help=DILATION_HELP + " (default: the files', 8)"),
    only: str = typer.Option("hierarchical,multitenant", "--only",
                             help="which experiments: hierarchical, multitenant or both"),
) -> None:
    """Aggregation trees on a fat-tree and two tenants sharing switch memory (static vs
    shared pool), against their targets (every row checked against numpy)."""
    from testbed.experiment.tenancy import main

    names = tuple(n.strip() for n in only.split(",") if n.strip())
    try:
        code = main(quick=quick, json_out=json_out, only=names,
                    time_dilation=_dilation(time_dilation))
    except ValueError as e:  # a bad --only: say so before any network is built
        raise typer.BadParameter(str(e), param_hint="--only") from None
    raise typer.Exit(code)


@bench_app.command("fidelity")
def bench_fidelity(json_out: bool = typer.Option(False, "--json"),
                   quick: bool = typer.Option(False, "--quick", help="one size (4 MiB)"),
                   programmable: bool = typer.Option(False, "--programmable",
                                                     help="data path on every switch"),
                   time_dilation: str = typer.Option("auto", "--time-dilation",
                                                     metavar="F|auto", help=DILATION_HELP),
                   tcp_cc: str = typer.Option(
                       None, "--tcp-cc", metavar="NAME|host[,...]",
                       help="TCP congestion control of ring, hd and rs (default: the "
                            "collectives' own, reno; 'host': each host's default); a list "
                            "runs each TCP algorithm once per entry on the same network"),
                   only: str = typer.Option(None, help="comma-separated networks (star4, "
                                                       "star8, leafspine-2:1, leafspine-4:1, "
                                                       "fattree-k4)"),
                   queue_ms: float = typer.Option(
                       None, "--queue-ms", metavar="MS",
                       help="every shaped link's queue in ms at its rate (default and 0: "
                            "the kernel's 1000 packets; 500: a lossless fabric, like the "
                            "model's)"),
                   ) -> None:
    """Collectives on star, leaf-spine and fat-tree against the flow-level model."""
    from testbed.experiment.fidelity import QUEUE_MS, main

    raise typer.Exit(main(json_out=json_out, quick=quick, programmable=programmable,
                          time_dilation=_dilation(time_dilation),
                          tcp_cc=tcp_cc.split(",") if tcp_cc else None,
                          only=only.split(",") if only else None,
                          queue_ms=QUEUE_MS if queue_ms is None else queue_ms or None))


@bench_app.command("capacity")
def bench_capacity(json_out: bool = typer.Option(False, "--json"),
                   workers: str = typer.Option("2,4,8,16", help="host counts of the sweep"),
                   io: str = typer.Option("ring", help="engine packet I/O: ring or mmsg"),
                   shaping: str = typer.Option(
                       "engine", help="who shapes the switch's ports: engine (its shape "
                                      "stage) or qdisc (the kernel's HTB)"),
                   sched: str = typer.Option(
                       "fifo", help="the engine's packet loop: fifo (real-time) or other "
                                    "(time-shared)"),
                   worker_send: str = typer.Option(
                       "gso", "--worker-send", help="how INA workers send: gso (UDP GSO runs) "
                                                    "or mmsg (a datagram per entry)"),
                   mib: int = typer.Option(8, help="allreduce size (MiB)"),
                   bw: float = typer.Option(100.0, help="link rate (Mb/s)"),
                   time_dilation: float = typer.Option(
                       1.0, "--time-dilation", help="run the sweep at this factor (>= 1)"),
                   dilate: str = typer.Option(
                       "8,16", help="host counts at which the smallest non-saturating "
                                    "dilation factor is searched ('' for none)")) -> None:
    """INA and ring on stars: most workers without CPU saturation, CPU per packet, and the
    smallest time dilation that keeps 8 and 16 workers below saturation."""
    from testbed.experiment.capacity import main

    def ints(opt: str, text: str) -> list[int]:
        try:
            return [int(w) for w in text.split(",") if w.strip()]
        except ValueError:
            raise typer.BadParameter(f"{opt} takes comma-separated integers, got "
                                     f"{text!r}") from None

    try:
        code = main(json_out=json_out, workers=ints("--workers", workers), io=io,
                    nbytes=mib << 20, bw_mbps=bw, time_dilation=time_dilation,
                    dilate_workers=ints("--dilate", dilate), shaping=shaping, sched=sched,
                    worker_send=worker_send)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    raise typer.Exit(code)


@bench_app.command("ina-cost")
def bench_ina_cost(json_out: bool = typer.Option(False, "--json"),
                   reps: int = typer.Option(5, help="runs per row (median, min, max)")) -> None:
    """CPU time per packet of the INA worker and switch kernels, without a network."""
    from testbed.experiment.ina_cost import main

    if reps < 1:
        raise typer.BadParameter(f"--reps must be at least 1, got {reps}")
    raise typer.Exit(main(json_out=json_out, reps=reps))


@bench_app.command("cluster")
def bench_cluster(json_out: bool = typer.Option(False, "--json"),
                  leaves: int = typer.Option(2, help="leaves of the leaf-spine (2 spines)"),
                  hosts_per_leaf: int = typer.Option(2, help="hosts per leaf"),
                  bw: float = typer.Option(100.0, help="link rate (Mb/s)")) -> None:
    """A leaf-spine on one machine vs split over it and a netns server: set-up time, memory
    per server, INA and ring (docs/cluster.md)."""
    from testbed.experiment.cluster_bench import main

    raise typer.Exit(main(json_out=json_out, leaves=leaves, hosts_per_leaf=hosts_per_leaf,
                          bw_mbps=bw))


@bench_app.command("torch")
def bench_torch(json_out: bool = typer.Option(False, "--json"),
                quick: bool = typer.Option(False, "--quick", help="3 ranks, 1 MiB of "
                                           "gradient, a few steps (about a minute)"),
                time_dilation: str = typer.Option(None, "--time-dilation", metavar="F|auto",
                                                  help=DILATION_HELP + " (the DDP runs)"),
                out: str = typer.Option(None, metavar="DIR", help=BENCH_OUT_HELP)) -> None:
    """The testbed process-group backend against gloo with an unmodified script: per-call
    overhead, DDP step time against the flow model, launch time and memory per rank."""
    from testbed.experiment.torch_bench import main

    raise typer.Exit(main(json_out=json_out, quick=quick,
                          time_dilation=_dilation(time_dilation), out=out))


@bench_app.command("all")
def bench_all(json_out: bool = typer.Option(False, "--json"),
              out: str = typer.Option(None, metavar="DIR", help=BENCH_OUT_HELP),
              quick: bool = typer.Option(False, "--quick", help="each one's quick form")
              ) -> None:
    """Kernels, data path and collectives in turn; exit status of the worst."""
    codes = [_bench_kernels(json_out, QUICK_ELEMENTS if quick else 25_000_000, out),
             _bench_datapath(json_out, out, quick), _bench_collectives(json_out, out, quick)]
    raise typer.Exit(max(codes))


if __name__ == "__main__":
    app()
