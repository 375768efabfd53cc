"""``testbed warm``: compile (or load from the cache) every Numba kernel the testbed's processes use.

Every kernel is compiled with ``cache=True``, so its machine code lands in ``__pycache__`` next
to the source the first time a process calls it and later processes only load it. On a fresh
checkout that first time costs one to two minutes of CPU, paid by whichever run comes first
(an engine starting inside an emulated network, a worker pool, a notebook cell), which then
looks slow and may even be flagged ``cpu_bound``. Warming the cache once, right after
installing (``make setup`` does) or while the CPU is otherwise idle (the test suite does it on
the second core while the unit tests run), takes that cost off every measured run.

Each family is warmed the way its processes call it (the same argument types, so the same
compiled specialisations): every data-path stage through an :class:`Engine` on an empty batch,
the INA worker loop, the host fallback aggregator, the trimmed gather, every built-in
compressor. A family that fails is reported and the others still run; the processes that use
it then compile it themselves, as without warming.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Warmed:
    """One kernel family: how long compiling (or loading) it took, and the error if it failed."""

    family: str
    seconds: float
    error: str | None = None


def _stage(name: str) -> Callable[[], None]:
    def run() -> None:
        from testbed.datapath.engine import Engine

        Engine({"ports": ["p0", "p1"], "programs": [name]}).warm_up()
    return run


def _compressor(name: str) -> Callable[[], None]:
    def run() -> None:
        from testbed.collectives import compress
        from testbed.collectives.spec import CollectiveSpec

        for ef in (False, True):
            compress.warm(CollectiveSpec(op="allreduce", algo="ring", nbytes=1024,
                                         compressor=name, error_feedback=ef))
    return run


def families() -> list[tuple[str, Callable[[], None]]]:
    """Every kernel family with the call that warms it (imports stay inside the calls, so a
    broken family does not stop the others)."""
    # here, not at the top: `testbed --help` must not import numba (start-up time)
    from testbed.collectives import fallback, ina, trimmed
    from testbed.datapath.programs import stage_names
    from testbed.kernels.compressors import COMPRESSORS

    out = [(f"stage {s}", _stage(s)) for s in stage_names()]
    out += [("ina worker", ina.warm_up), ("host fallback", fallback.warm_up),
            ("trimmed gather", trimmed.warm)]
    out += [(f"compressor {c}", _compressor(c)) for c in COMPRESSORS]
    return out


def warm_all(progress: Callable[[Warmed], None] | None = None) -> list[Warmed]:
    """Warm every family in :func:`families`; ``progress`` is called after each one."""
    done = []
    for family, call in families():
        t0 = time.perf_counter()
        err = None
        try:
            call()
        except Exception as e:  # noqa: BLE001 - reported per family, the others still run
            err = f"{type(e).__name__}: {e}"
        w = Warmed(family, time.perf_counter() - t0, err)
        done.append(w)
        if progress is not None:
            progress(w)
    return done


def main(argv: list[str] | None = None) -> int:
    """Warm every family, print one line each; exit status 1 when a family failed."""
    ap = argparse.ArgumentParser(prog="testbed warm", description=__doc__.splitlines()[0])
    ap.add_argument("--quiet", action="store_true", help="print only failures and the total")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    def show(w: Warmed) -> None:
        if w.error or not args.quiet:
            print(f"{w.family:<24} {w.seconds:7.2f} s  {w.error or 'ok'}", flush=True)

    done = warm_all(show)
    failed = [w.family for w in done if w.error]
    print(f"warmed {len(done) - len(failed)}/{len(done)} kernel families in "
          f"{time.perf_counter() - t0:.1f} s" + (f"; failed: {', '.join(failed)}" if failed
                                                 else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
