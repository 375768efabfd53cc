"""The ``testbed`` command line.

Each subcommand lives in the module that owns it and is imported only when used, so
``testbed --help`` stays fast (no numba, no mininet import).
"""

from __future__ import annotations

import typer

app = typer.Typer(
    help="Emulation testbed for offloading AI collectives to the network.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks: print ratios against anchors measured in the same run.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@app.command()
def doctor(json_out: bool = typer.Option(False, "--json", help="print the checks as JSON")) -> None:
    """Check what the testbed needs against what this machine offers."""
    from testbed.doctor import main

    raise typer.Exit(main(json_out=json_out))


@app.command()
def cleanup(
    force: bool = typer.Option(False, "--force", help="do not wait for a running network's lock"),
) -> None:
    """Remove only what the testbed created (namespaces, links, processes, bridges)."""
    from testbed.cleanup import main

    raise typer.Exit(main(force=force))


@app.command()
def lab(
    port: int = typer.Option(8888, help="port JupyterLab listens on"),
    ip: str = typer.Option("0.0.0.0", help="address to listen on (0.0.0.0 for the lab VM)"),
) -> None:
    """Start JupyterLab on notebooks/ (with the flags running as root needs)."""
    from testbed.lab import main

    raise typer.Exit(main(port=port, ip=ip))


@app.command()
def demo() -> None:
    """Run the embedded default experiment and print what it measured."""
    from testbed.demo import main

    raise typer.Exit(main())


@app.command()
def run(
    file: str = typer.Argument(..., help="experiment file (TOML or YAML)"),
    out: str = typer.Option("results", help="results folder"),
) -> None:
    """Run an experiment file and write its results."""
    from testbed.experiment.cli import run_file

    raise typer.Exit(run_file(file, out))


@bench_app.command("kernels")
def bench_kernels(
    json_out: bool = typer.Option(False, "--json"),
    elements: int = typer.Option(25_000_000, help="gradient length (float32 elements)"),
) -> None:
    """Numba kernels against numpy anchors (GB/s)."""
    from testbed.kernels.bench import main

    raise typer.Exit(main(json_out=json_out, elements=elements))


@bench_app.command("datapath")
def bench_datapath(json_out: bool = typer.Option(False, "--json")) -> None:
    """Data path programs against Linux bridge, OVS userspace and a Python forwarder (kpps)."""
    from testbed.datapath.bench import main

    raise typer.Exit(main(json_out=json_out))


@bench_app.command("collectives")
def bench_collectives(json_out: bool = typer.Option(False, "--json")) -> None:
    """Allreduce algorithms on a star against the alpha-beta model."""
    from testbed.collectives.bench import main

    raise typer.Exit(main(json_out=json_out))


@bench_app.command("fidelity")
def bench_fidelity(json_out: bool = typer.Option(False, "--json"),
                   quick: bool = typer.Option(False, "--quick", help="one size (4 MiB)"),
                   programmable: bool = typer.Option(False, "--programmable",
                                                     help="data path on every switch")) -> None:
    """Collectives on star, leaf-spine and fat-tree against the flow-level model."""
    from testbed.experiment.fidelity import main

    raise typer.Exit(main(json_out=json_out, quick=quick, programmable=programmable))


@bench_app.command("all")
def bench_all(json_out: bool = typer.Option(False, "--json")) -> None:
    """Every benchmark in turn (kernels, data path, collectives); exit status of the worst."""
    from testbed.collectives.bench import main as collectives
    from testbed.datapath.bench import main as datapath
    from testbed.kernels.bench import main as kernels

    codes = [kernels(json_out=json_out, elements=25_000_000), datapath(json_out=json_out),
             collectives(json_out=json_out)]
    raise typer.Exit(max(codes))


if __name__ == "__main__":
    app()
