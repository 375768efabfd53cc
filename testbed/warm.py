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

Each family warmed is recorded in a stamp beside the package's cache with a fingerprint of the
sources (every ``.py`` of the package, by size and modification time, and the Numba version).
A network about to start its engines calls :func:`ensure_stages` for the stages its programs
use: when their stamps match it costs a few stats, otherwise it warms them once, in one
process under a lock, with a progress line; twenty engines that compile the same kernels at
once on two cores would each take twenty times as long, past their start-up timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
#: folders whose sources the kernels are compiled from (the package and its mapped folders)
_SOURCES = (_PACKAGE, _PACKAGE.parent / "kernels", _PACKAGE.parent / "topologies")
STAMP_PATH = Path(os.environ.get("NUMBA_CACHE_DIR") or _PACKAGE / "__pycache__") / \
    "testbed-warm.json"


#: the family of the engine groups' own kernel (testbed.datapath.group)
GROUP_FAMILY = "engine group"


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
    from testbed.datapath import group
    from testbed.datapath.programs import stage_names
    from testbed.kernels.compressors import COMPRESSORS

    out = [(f"stage {s}", _stage(s)) for s in stage_names()]
    out += [(GROUP_FAMILY, group.warm_up)]
    out += [("ina worker", ina.warm_up), ("host fallback", fallback.warm_up),
            ("trimmed gather", trimmed.warm)]
    out += [(f"compressor {c}", _compressor(c)) for c in COMPRESSORS]
    return out


def fingerprint() -> str:
    """What the compiled kernels depend on: every source file's size and time, Numba's
    version (a changed source makes Numba recompile; the stamp must expire with it)."""
    h = hashlib.sha256(f"{metadata.version('numba')} {sys.version}".encode())
    for root in _SOURCES:
        for path in sorted(root.rglob("*.py")) if root.is_dir() else []:
            st = path.stat()
            h.update(f"{path} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _cache_entries() -> int:
    """How many Numba cache indexes the package's sources have: fewer than at stamping means
    someone removed compiled kernels (``make setup`` drops those older than a changed source)."""
    root = Path(os.environ["NUMBA_CACHE_DIR"]) if os.environ.get("NUMBA_CACHE_DIR") else None
    if root is not None:
        return sum(1 for _ in root.rglob("*.nbi"))
    return sum(1 for r in _SOURCES if r.is_dir() for _ in r.rglob("__pycache__/*.nbi"))


def _read_stamp() -> dict:
    try:
        return json.loads(STAMP_PATH.read_text())
    except (OSError, ValueError):
        return {}


def _write_stamp(families_ok: Iterable[str], print_: str) -> None:
    stamp = _read_stamp()
    if stamp.get("fingerprint") != print_:
        stamp = {"fingerprint": print_, "families": []}
    stamp["families"] = sorted(set(stamp["families"]) | set(families_ok))
    stamp["cache_entries"] = _cache_entries()
    try:
        STAMP_PATH.parent.mkdir(parents=True, exist_ok=True)
        tmp = STAMP_PATH.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(stamp))
        os.replace(tmp, STAMP_PATH)
    except OSError:
        pass  # a read-only install: every network checks again, and loads the caches


def cold_families(wanted: Iterable[str]) -> list[str]:
    """Those of ``wanted`` not warmed since the sources last changed."""
    stamp = _read_stamp()
    valid = (stamp.get("fingerprint") == fingerprint()
             and _cache_entries() >= stamp.get("cache_entries", 0))
    done = set(stamp.get("families", ())) if valid else set()
    return [f for f in dict.fromkeys(wanted) if f not in done]


@contextlib.contextmanager
def compile_lock():
    """Hold the machine-wide lock beside the stamp while compiling or loading kernels whose
    specialisations depend on the caller (an engine's ring kernels, one per port count):
    Numba's cache index is not safe against two processes writing it at once (each may
    number its file ``.1`` and the index end up naming the other's code: "size mismatch
    for tuple" at the next load)."""
    STAMP_PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(STAMP_PATH.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_stages(stages: Iterable[str], timeout: float = 900.0,
                  groups: bool = False) -> list[str]:
    """Warm the data-path stages ``stages`` (and with ``groups`` the engine groups' loop)
    unless their stamps say they are warm; return the families that were warmed (empty on a
    warm cache). Compiles in a child process (the
    caller keeps no Numba state it does not use), one at a time machine-wide (a lock beside
    the stamp), printing a progress line; a family that fails to compile is left to the
    engines, whose start-up error then says why."""
    wanted = [f"stage {s}" for s in stages] + ([GROUP_FAMILY] if groups else [])
    if not cold_families(wanted):
        return []
    with compile_lock():
        cold = cold_families(wanted)  # another process may have warmed them meanwhile
        if not cold:
            return []
        print(f"testbed: compiling the data-path kernels of {', '.join(cold)} once "
              "(a fresh checkout or changed sources: up to a few CPU-minutes; "
              "'testbed warm' does every kernel ahead)", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        print_ = fingerprint()
        r = subprocess.run([sys.executable, "-m", "testbed.warm", "--quiet", "--only",
                            ",".join(cold)], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=timeout, check=False)
        if r.returncode == 0:
            _write_stamp(cold, print_)
        print(f"testbed: kernels compiled in {time.monotonic() - t0:.0f} s"
              + ("" if r.returncode == 0 else f"; some failed, their engines compile them:\n"
                 f"{r.stdout.strip()}"), file=sys.stderr, flush=True)
    return cold


def warm_all(progress: Callable[[Warmed], None] | None = None,
             only: Iterable[str] | None = None) -> list[Warmed]:
    """Warm every family in :func:`families` (or those named in ``only``); ``progress`` is
    called after each one. The families that worked are stamped."""
    print_ = fingerprint()
    chosen = families()
    if only is not None:
        names = set(only)
        unknown = names - {f for f, _ in chosen}
        if unknown:
            raise ValueError(f"no kernel family {sorted(unknown)}; families: "
                             f"{[f for f, _ in chosen]}")
        chosen = [(f, c) for f, c in chosen if f in names]
    done = []
    for family, call in chosen:
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
    _write_stamp((w.family for w in done if w.error is None), print_)
    return done


def main(argv: list[str] | None = None) -> int:
    """Warm every family, print one line each; exit status 1 when a family failed."""
    ap = argparse.ArgumentParser(prog="testbed warm", description=__doc__.splitlines()[0])
    ap.add_argument("--quiet", action="store_true", help="print only failures and the total")
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    def show(w: Warmed) -> None:
        if w.error or not args.quiet:
            print(f"{w.family:<24} {w.seconds:7.2f} s  {w.error or 'ok'}", flush=True)

    only = [f.strip() for f in args.only.split(",") if f.strip()] or None
    try:
        done = warm_all(show, only)
    except ValueError as e:
        print(f"testbed warm: {e}", file=sys.stderr)
        return 2
    failed = [w.family for w in done if w.error]
    print(f"warmed {len(done) - len(failed)}/{len(done)} kernel families in "
          f"{time.perf_counter() - t0:.1f} s" + (f"; failed: {', '.join(failed)}" if failed
                                                 else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
