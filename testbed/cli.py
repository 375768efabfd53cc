"""The ``testbed`` command line.

Each subcommand lives in the module that owns it and is imported only when used, so
``testbed --help`` stays fast (no numba, no mininet import).
"""

from __future__ import annotations

import json
import sys
import time

import typer

from testbed.bench.protocol import UNCHANGED
from testbed.bench.protocol import parse_dilation as _dilation

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
link_app = typer.Typer(
    help="Fail or restore a link of the network 'testbed up' runs: testbed link down|up A B "
         "(routes are recomputed around it).",
    no_args_is_help=True)
app.add_typer(link_app, name="link")
provider_app = typer.Typer(
    help="The fabric manager: serve it over a network, or ask it about jobs, plans and "
         "telemetry: testbed provider serve FILE | status | jobs | plan [JOB] [--policy P].",
    no_args_is_help=True)
app.add_typer(provider_app, name="provider")

OUT_HELP = ("results root: a folder <name>-<time>/ is created in it (default: $TESTBED_RESULTS, "
            "else results/ of the checkout, else ~/testbed-results)")
BENCH_OUT_HELP = ("also store the rows (jsonl, csv, parquet), metadata and a plot in "
                  "DIR/bench-<name>-<time>/")
POLICY_HELP = ("with --algo auto: the provider's policy (tenant_only, provider_only, "
               "cooperative, cooperative_alone, cooperative_static, cooperative_no_congestion, "
               "oracle)")
DILATION_HELP = ("run the network F times slower (links at bw/F, delays and timeouts times F) "
                 "and report undilated times; 'auto' calibrates the smallest F that keeps the "
                 "CPU unsaturated")




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

    names = [s for s in servers.split(",") if s.strip()]
    if not names:
        raise typer.Exit(main(force=force))
    from testbed.topologies.cluster import cleanup_servers

    raise typer.Exit(main(force=force, clean=lambda: cleanup_servers(names)))


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
    nproc_per_host: int = typer.Option(1, "--nproc-per-host", min=1, help="ranks on each "
                                       "host (torchrun's --nproc-per-node; with plain gloo or a "
                                       "TCP algorithm)"),
    experiment: str = typer.Option(None, "--experiment", "-e",
                                   help="an experiment file whose network to use"),
    algo: str = typer.Option(None, "--algo", help="the testbed algorithm the script's float32 "
                             "allreduces take (ring, hd, ina, nic, a plug-in; auto: the "
                             "provider's plan for the job's hints; default: plain gloo, the "
                             "baseline)"),
    compressor: str = typer.Option(None, "--compressor", help="with --algo: compress them"),
    error_feedback: bool = typer.Option(False, "--error-feedback"),
    transport: str = typer.Option("tcp", "--transport", metavar="tcp|uet", help="with --algo: "
                                  "what carries ring/hd messages (uet: sprayed UDP that a UET "
                                  "switch trims, NACKed and resent; one rank per host); with "
                                  "--algo auto or --provider: the provider may plan the ring "
                                  "over uet, with trimming on its ports"),
    policy: str = typer.Option("cooperative", "--policy", help=POLICY_HELP),
    provider: str = typer.Option(None, "--provider", metavar="ADDRESS|default",
                                 help="run as a tenant of the provider that serves the "
                                      "network 'testbed up' runs ('testbed provider serve "
                                      "--attach'; default: its socket): admitted with the "
                                      "hints below, planned and re-planned by it"),
    tolerance: str = typer.Option(None, "--tolerance", metavar="exact|lossy|lossy_ef",
                                  help="with --algo auto or --provider: the job's hint (lossy "
                                       "allows compression within --error-budget)"),
    error_budget: float = typer.Option(None, "--error-budget", help="with --algo auto or "
                                       "--provider: relative L2 error one allreduce may have"),
    hint_bytes: int = typer.Option(None, "--hint-bytes", help="with --algo auto or --provider: "
                                   "bytes allreduced per iteration (the gradient's size); "
                                   "without it the launcher derives them from the job's first "
                                   "iterations and the provider may re-plan the running job"),
    priority: int = typer.Option(None, "--priority", help="with --algo auto or --provider: "
                                 "0-7, larger first"),
    chakra_out: str = typer.Option(None, "--chakra-out", metavar="DIR", help="also write the "
                                   "job's collectives as a Chakra trace, DIR/<script>.<rank>.et "
                                   "(needs --algo; testbed replay runs it)"),
    tree: str = typer.Option(None, "--tree", metavar="auto|single|SW1,SW2",
                             help="with --algo ina or nic: the aggregation tree (default: one "
                                  "switch, auto above 32 ranks)"),
    bw_mbps: float = typer.Option(None, "--bw-mbps", help="link rate of the default star"),
    time_dilation: str = typer.Option(None, "--time-dilation", metavar="F|auto",
                                      help=DILATION_HELP),
    timeout: float = typer.Option(600.0, "--timeout", help="seconds before the job is stopped"),
    out: str = typer.Option(None, help=OUT_HELP),
) -> None:
    """Run a PyTorch script on the emulated hosts, torchrun-style (exit: the worst rank's)."""
    from testbed.launch import launch as run_script

    hints = {k: v for k, v in (("tolerance", tolerance), ("error_budget", error_budget),
                               ("collective_bytes", hint_bytes), ("priority", priority))
             if v is not None}
    try:
        done = run_script(script, args or [], hosts=hosts, experiment=experiment, algo=algo,
                          compressor=compressor, error_feedback=error_feedback,
                          topology={"bw_mbps": bw_mbps} if bw_mbps else None,
                          time_dilation=_dilation(time_dilation), timeout_s=timeout, out=out,
                          hints=hints or None, policy=policy, chakra_out=chakra_out,
                          nproc_per_host=nproc_per_host, transport=transport,
                          provider=True if provider == "default" else provider, tree=tree)
    except ValueError as e:
        print(f"testbed launch: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    if done.plan is not None:
        p = done.plan
        who = f"at {provider}" if provider else f"({policy})"
        print(f"testbed launch: the provider {who} planned {p['algo']}"
              + (f" + {p['compressor']}" if p["compressor"] else "")
              + (f" on {p['tree']}" if p["tree"] else "") + f": {p['reason']}",
              file=sys.stderr)
    if done.replans:
        print(f"testbed launch: re-planned while it ran: {done.replans}", file=sys.stderr)
    for line in done.failures:
        print(f"testbed launch: {line}", file=sys.stderr)
    if done.chakra:
        print(f"testbed launch: Chakra trace {str(done.chakra[0])[:-5]}.{{0..{len(done.chakra) - 1}}}"
              ".et (testbed replay takes its prefix)", file=sys.stderr)
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
    prefixes: list[str] = typer.Argument(..., metavar="PREFIX...", help="the trace: files "
                                         "PREFIX.0.et, PREFIX.1.et, ...; several traces run "
                                         "at once as tenants, each on hosts of its own"),
    experiment: str = typer.Option(None, "--experiment", "-e",
                                   help="an experiment file whose network to use (default: a "
                                        "star with a host per rank at 100 Mb/s)"),
    algo: str = typer.Option(None, "--algo", help="the testbed algorithm of its float32 "
                             "allreduces (ring, hd, ina, nic, a plug-in; auto: the provider "
                             "plans each trace from its hints; default: gloo)"),
    policy: str = typer.Option("cooperative", "--policy", help=POLICY_HELP),
    provider: str = typer.Option(None, "--provider", metavar="ADDRESS|default",
                                 help="run as a tenant of the provider that serves the "
                                      "network 'testbed up' runs ('testbed provider serve "
                                      "--attach'; default: its socket): admitted with the "
                                      "hints below, planned and re-planned by it"),
    tolerance: str = typer.Option(None, "--tolerance", metavar="exact|lossy|lossy_ef",
                                  help="with --algo auto: every trace's hint (default: the "
                                       "bytes and compute time its trace shows)"),
    arrivals: str = typer.Option(None, "--arrivals", metavar="S,S,...", help="with several "
                                 "traces: when each starts, undilated seconds (default: all "
                                 "at 0)"),
    bw_mbps: float = typer.Option(None, "--bw-mbps", help="link rate of the default star"),
    scale: float = typer.Option(1.0, "--scale", help="factor on the compute durations"),
    time_dilation: str = typer.Option(None, "--time-dilation", metavar="F|auto",
                                      help=DILATION_HELP),
    timeout: float = typer.Option(600.0, "--timeout", help="seconds before it is stopped"),
    comm_groups: list[str] = typer.Option(None, "--comm-groups", help="communicator groups as "
                                          "ASTRA-sim's --comm-group-configuration JSON: "
                                          '{"1": [0, 1], ...} (pg_name -> ranks); with '
                                          "several traces, once per trace in order"),
    json_out: bool = typer.Option(False, "--json", help="print the validation rows (with "
                                  "several traces, the tenants' rows) as JSON"),
    out: str = typer.Option(None, help=OUT_HELP),
) -> None:
    """Replay Chakra execution traces on the emulated fabric and validate them against the
    flow model (exit: 0 ok, 1 a rank failed, 2 a trace that cannot be replayed)."""
    from testbed.bench.store import print_rows
    from testbed.replay import TraceError, replay_tenants

    try:
        tenants = _replay_tenants(prefixes, algo, tolerance, arrivals, scale, comm_groups)
        res = replay_tenants(tenants, experiment=experiment,
                             topology={"bw_mbps": bw_mbps} if bw_mbps else None,
                             time_dilation=_dilation(time_dilation), timeout_s=timeout,
                             out=out, echo=lambda line: None, policy=policy)
    except (TraceError, ValueError) as e:
        print(f"testbed replay: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    for r in res.replayed:
        for line in r.launched.failures:
            print(f"testbed replay: {line}", file=sys.stderr)
    for row in res.tenants:
        if row.get("error"):
            print(f"testbed replay: {row['tenant']}: {row['error']}", file=sys.stderr)
    if len(tenants) > 1:
        if json_out:
            for row in res.tenants:
                print(json.dumps(row, default=str))
        else:
            print_rows(res.tenants, f"replay of {len(tenants)} traces at once",
                       ("tenant", "ranks", "arrival_s", "start_s", "jct_s", "model_jct_s",
                        "slowdown", "algo", "planned", "replans", "failed"))
        print(f"testbed replay: results: {res.folder}", file=sys.stderr)
        raise typer.Exit(1 if any(row["failed"] for row in res.tenants) else 0)
    one = res.replayed[0]
    if json_out:
        for row in one.validation:
            print(json.dumps(row, default=str))
    else:
        print_rows(one.validation, f"replay of {prefixes[0]}: measured vs flow model",
                   ("op", "bytes", "path", "count", "measured_s", "predicted_s", "error_pct"))
    geo = "n/a" if one.geomean_error_pct is None else f"{one.geomean_error_pct:.1f} %"
    model = "n/a" if one.model_jct_s is None else f"{one.model_jct_s:.4g} s"
    print(f"testbed replay: JCT {one.jct_s:.4g} s (model {model}), {len(one.collectives)} "
          "collectives, "
          f"geomean error {geo}; results: {one.folder}", file=sys.stderr)
    raise typer.Exit(1 if one.launched.returncode else 0)


def _replay_tenants(prefixes: list[str], algo, tolerance, arrivals, scale, comm_groups):
    """``testbed replay``'s tenants from its options; ValueError naming the bad one."""
    from pathlib import Path

    from testbed.replay import Tenant

    if tolerance is not None and algo != "auto":
        raise ValueError("--tolerance is a hint for --algo auto")
    at = [0.0] * len(prefixes)
    if arrivals is not None:
        try:
            at = [float(x) for x in arrivals.split(",")]
        except ValueError:
            raise ValueError(f"--arrivals {arrivals!r}: give seconds, comma-separated") \
                from None
        if len(at) != len(prefixes):
            raise ValueError(f"--arrivals has {len(at)} times for {len(prefixes)} traces")
    groups = list(comm_groups or [])
    if groups and len(groups) != len(prefixes):
        raise ValueError(f"--comm-groups given {len(groups)} times for {len(prefixes)} "
                         "traces: once per trace, in order")
    hints = {"tolerance": tolerance} if tolerance else None
    return [Tenant(p, arrival_s=at[k], algo=algo, scale=scale,
                   groups=groups[k] if groups else None,
                   hints=hints, name=f"{k}-{Path(p).name}" if len(prefixes) > 1 else None)
            for k, p in enumerate(prefixes)]


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


@switch_app.command("restart")
def switch_restart(ctx: typer.Context, json_out: bool = JSON_OPT) -> None:
    """Start the node's engine again (dead or running) in the network 'testbed up' runs: its
    programs and tables as built; registered jobs are gone (a provider registers its own
    again)."""
    from testbed import up

    node = ctx.obj
    _ask_up(f"testbed switch {node} restart", lambda: up.restart(node), json_out,
            lambda a: f"{node}: engine restarted in {a['seconds']} s")


def _ask_up(command: str, ask, json_out: bool, done) -> None:
    """Print the answer of the ``testbed up`` process to ``ask()`` (``done(answer)``: the line
    when it was done); exit 1 naming ``command`` when it could not."""
    try:
        answer = ask()
    except RuntimeError as e:
        print(f"{command}: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    if json_out:
        print(json.dumps(answer))
    elif answer["ok"]:
        print(done(answer))
    if not answer["ok"]:
        print(f"{command}: {answer['error']}", file=sys.stderr)
        raise typer.Exit(1)


def _link(a: str, b: str, state: str, json_out: bool) -> None:
    from testbed import up

    _ask_up(f"testbed link {state} {a} {b}", lambda: up.link(a, b, state), json_out,
            lambda x: f"{x['link']}: {state} ({', '.join(x['interfaces'])}); "
                      f"{x['routes_changed']} routes changed in {x['seconds']} s")


LINK_A = typer.Argument(..., help="one end of the link (a switch or host name, e.g. tbl1)")
LINK_B = typer.Argument(..., help="the other end (e.g. tbsp1)")


@link_app.command("down")
def link_down(a: str = LINK_A, b: str = LINK_B,
              json_out: bool = typer.Option(False, "--json", help="print the answer as JSON")
              ) -> None:
    """Fail the link between A and B: its interfaces go down, then every switch's routes are
    recomputed over the links left (ECMP over the remaining paths); refused when it would
    cut a host off."""
    _link(a, b, "down", json_out)


@link_app.command("up")
def link_up(a: str = LINK_A, b: str = LINK_B,
            json_out: bool = typer.Option(False, "--json", help="print the answer as JSON")
            ) -> None:
    """Restore a failed link: its interfaces come up, then the routes use it again."""
    _link(a, b, "up", json_out)


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
    file: str = typer.Argument(None, help="experiment file whose topology (and programs) to "
                               "serve (with --attach: default, the file of the network up)"),
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
    attach: bool = typer.Option(False, "--attach", help="serve the network 'testbed up' runs "
                                "(the provider can then stop and restart while it runs)"),
    journal: str = typer.Option(None, help="SQLite file to keep jobs, leases, plans and switch "
                                "registrations in, and to resume from on the next start"),
    quotas: str = typer.Option(None, help="TOML/JSON file of per-tenant quotas (jobs, priority, "
                               "memory_bytes, trees_per_switch; tenant \"*\": everyone else)"),
    trust_hints: bool = typer.Option(False, "--trust-hints", help="rank jobs for switch "
                                     "memory on their hints at once (default: only once "
                                     "telemetry confirmed them; a liar is still caught)"),
) -> None:
    """Build the file's network (or --attach to the one up) and run the fabric manager on it
    until Ctrl-C."""
    from testbed.provider import ctl
    from testbed.provider.service import DEFAULT_SOCKET

    raise typer.Exit(ctl.serve(file, point=point, policy=policy, memory_bytes=memory_bytes,
                               socket_path=socket or DEFAULT_SOCKET, port=port,
                               telemetry_period_s=telemetry_period, network=network,
                               attach=attach, journal=journal, quotas=quotas,
                               trust_hints=trust_hints))


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

def _bench_command(bench):
    """A command for ``bench`` (a :class:`testbed.bench.Benchmark`): its declared options, each
    given or left to its default (and to its ``--quick`` value under ``--quick``), and the
    options every benchmark has: --quick, --json, --out."""
    import inspect

    from testbed.bench import run_benchmark

    params = []
    for o in bench.options:
        quick = "" if o.quick is UNCHANGED else f"; --quick: {o.quick!r}"
        default = "" if o.default is None else f" (default: {o.default!r}{quick})"
        if not default and quick:
            default = f" ({quick[2:]})"
        flag = f"{o.flag}/--no-{o.flag[2:]}" if o.kind is bool else o.flag
        params.append(inspect.Parameter(
            o.name, inspect.Parameter.KEYWORD_ONLY, annotation=o.kind | None,
            default=typer.Option(None, flag, help=o.help + default, metavar=o.metavar,
                                 show_default=False)))
    params += [
        inspect.Parameter("quick", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                          default=typer.Option(False, "--quick", help=bench.quick_help)),
        inspect.Parameter("json_out", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                          default=typer.Option(False, "--json", help=BENCH_JSON_HELP)),
        inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
                          default=typer.Option(None, "--out", metavar="DIR",
                                               help=BENCH_OUT_HELP))]

    def command(**kw) -> None:
        quick, json_out, out = kw.pop("quick"), kw.pop("json_out"), kw.pop("out")
        raise typer.Exit(run_benchmark(bench.name, kw, quick=quick, json_out=json_out, out=out))

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = bench.summary
    command.__name__ = f"bench_{bench.name.replace('-', '_')}"
    return command


BENCH_JSON_HELP = ("one JSON object per row as it is measured, then a summary object "
                   "(\"summary\": true: status, targets, notes)")


def _register_benchmarks() -> None:
    from testbed.bench import CATALOG

    for bench in CATALOG.values():
        bench_app.command(bench.name)(_bench_command(bench))


@bench_app.command("all")
def bench_all(json_out: bool = typer.Option(False, "--json", help=BENCH_JSON_HELP),
              out: str = typer.Option(None, metavar="DIR", help=BENCH_OUT_HELP),
              quick: bool = typer.Option(False, "--quick", help="each one's quick form"),
              only: str = typer.Option(None, "--only", metavar="A,B",
                                       help="only these benchmarks (default: all)"),
              skip: str = typer.Option("", "--skip", metavar="A,B",
                                       help="all but these benchmarks")) -> None:
    """Every benchmark in turn, each with its defaults (or its --quick form); one that cannot
    run on this machine is skipped with the reason. Exit status: the worst of those that ran."""
    from testbed.bench import benchmark_names, run_benchmark

    def names(text: str | None) -> list[str]:
        picked = [n.strip() for n in (text or "").split(",") if n.strip()]
        bad = sorted(set(picked) - set(benchmark_names()))
        if bad:
            raise typer.BadParameter(f"unknown benchmark {', '.join(bad)}; choose from "
                                     f"{', '.join(benchmark_names())}")
        return picked

    chosen = names(only) or list(benchmark_names())
    dropped = set(names(skip))
    codes = {}
    todo = [n for n in chosen if n not in dropped]
    t0 = time.monotonic()
    for k, name in enumerate(todo):
        spent = time.monotonic() - t0
        print(f"== testbed bench {name}{' --quick' if quick else ''} ({k + 1} of {len(todo)}, "
              f"{spent / 60:.0f} min so far)", file=sys.stderr, flush=True)
        codes[name] = run_benchmark(name, quick=quick, json_out=json_out, out=out)
        if codes[name] == 130:  # Ctrl-C: what was measured is kept; the rest is not started
            print("== bench all: interrupted", file=sys.stderr)
            raise typer.Exit(130)
    ran = {n: c for n, c in codes.items() if c != 2}
    print("== bench all: " + ", ".join(f"{n} {'ok' if c == 0 else f'exit {c}'}"
                                       for n, c in codes.items()), file=sys.stderr)
    raise typer.Exit(max(ran.values(), default=2))


_register_benchmarks()


if __name__ == "__main__":
    app()
