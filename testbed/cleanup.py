"""``testbed cleanup``: remove what the testbed created, and only that.

What counts as ours (docs/architecture.md, "Naming"):

* processes: Mininet shells (``bash ... mininet:tb*``), ``python -m testbed.datapath.engine``,
  ``python -m testbed.collectives.worker`` (and the other pools), anything whose argv carries
  ``testbed-node=``, daemons that keep their files under the testbed run folder
  (``/run/testbed/``, e.g. the OVS anchor of the data-path benchmark), and every process
  living in a network namespace that is ours: not the one cleanup runs in, holding no
  interface but ``lo`` and ``tb*`` ones, and either holding a ``tb*`` interface, named
  ``tb-*``, or running a marked process (a Mininet host whose veth is gone);
* interfaces named ``tb*`` in the root namespace (veths, bridges, ifbs, OVS taps), except one
  holding an IPv4 address (never one of ours; a netns server's veth, gone with its namespace);
* named network namespaces ``tb-*``;
* OVS bridges named ``tb*`` in any reachable OVS database;
* files and folders: everything in the run folder ``/run/testbed/`` but the emulation lock
  and a socket a live process listens on (engines' configs and logs, jobs' folders, a netns
  server's keys, ``testbed up``'s state), and the system temporary folder's entries made by
  :func:`temp_dir` (named ``tb-<kind>-*``, kinds :data:`TEMP_KINDS`).

Nothing is matched by a broad pattern: every rule above needs the ``tb`` prefix or one of our
markers. The caller holds the emulation lock while cleaning, so whatever is still there then
belongs to a run that is dead.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass

from testbed import PREFIX
from testbed.lifeline import start_ticks
from testbed.netlock import LOCK_PATH, EmulationBusy, emulation_lock

NETNS_PREFIX = f"{PREFIX}-"
# Fixed, not derived from an overridable path: a broad folder (/tmp) would match everyone.
RUN_DIR = "/run/testbed"
OUR_MODULES = ("testbed.datapath.engine", "testbed.collectives.worker",
               "testbed.collectives.remotepool", "testbed.workloads.pool", "testbed.launch")
NODE_MARKER = "testbed-node="
KINDS = ("ovs_bridges", "processes", "links", "netns", "files")
#: what the testbed keeps in the system temporary folder, one kind per user (temp_dir(kind))
TEMP_KINDS = ("net", "ssh", "srv-key", "flows", "incast")
DEFAULT_OVS_DB = "/var/run/openvswitch/db.sock"


@dataclass(frozen=True)
class _Proc:
    pid: int
    argv: tuple[str, ...]
    start: str  # start time in clock ticks: tells a reused pid apart
    netns: int | None
    why: str

    def describe(self) -> str:
        cmd = " ".join(self.argv)
        return f"{self.pid} {cmd[:100]}{'…' if len(cmd) > 100 else ''} ({self.why})"


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _netns_inode(pid: int | str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _protected_pids() -> set[int]:
    """This process and its ancestors: never ours to kill (e.g. a shell that typed a marker)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        raw = _read(f"/proc/{pid}/stat")
        if raw is None:
            break
        pid = int(raw.rsplit(b")", 1)[-1].split()[1])
    return pids


def _argv_reason(argv: tuple[str, ...]) -> str | None:
    """Why this command line is one the testbed started, or None.

    Markers must be whole arguments (no substring of a shell's ``-c`` script matches), so
    someone's ``grep testbed-node= ...`` is never taken for a node of ours.
    """
    for i, arg in enumerate(argv):
        if arg.startswith(f"mininet:{PREFIX}"):
            return "Mininet node shell"
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] in OUR_MODULES:
            return argv[i + 1]
        if arg.startswith(NODE_MARKER):
            return "testbed-node marker"
        if any(c.isspace() for c in arg):
            continue
        if arg.startswith(RUN_DIR + "/") or f"={RUN_DIR}/" in arg or f":{RUN_DIR}/" in arg:
            return f"files under {RUN_DIR}"
    return None


def _iface_names_of_pid(pid: int) -> list[str] | None:
    """Interface names in the network namespace of ``pid`` (from /proc, no setns needed)."""
    raw = _read(f"/proc/{pid}/net/dev")
    if raw is None:
        return None
    return [line.split(":", 1)[0].strip() for line in raw.decode().splitlines()[2:] if ":" in line]


def _own_netns() -> int | None:
    """The namespace cleanup runs in: where Mininet keeps its switches and root-side links.

    Never ours to clear. (Not pid 1's: /proc/1/ns may be unreadable even to root.)
    """
    return _netns_inode("self")


def _named_netns() -> list[str]:
    """Named network namespaces with the testbed prefix (``ip netns list``)."""
    try:
        names = sorted(os.listdir("/run/netns"))
    except OSError:
        return []
    return [n for n in names if n.startswith(NETNS_PREFIX)]


def _our_namespaces(by_ns: dict[int, list[tuple[int, tuple[str, ...], str | None]]]
                    ) -> dict[int, str]:
    """Network namespaces whose every process is ours, with the reason.

    A namespace qualifies only if it is not the one cleanup runs in and holds no interface
    but ``lo`` and ``tb*`` ones; then it must be a ``tb-*`` named namespace, hold ``tb*``
    interfaces, or run a process of ours (a Mininet host whose veth is already gone).
    """
    own = _own_netns()
    if own is None:  # cannot tell the root namespace apart: namespace rules stay off
        return {}
    named = {}
    for name in _named_netns():
        try:
            named[os.stat(f"/run/netns/{name}").st_ino] = f"in named netns {name}"
        except OSError:
            pass
    ours = {}
    for ns, procs in by_ns.items():
        if ns == own:
            continue
        ifaces = _iface_names_of_pid(procs[0][0])
        if ifaces is None:
            continue
        ifaces = [i for i in ifaces if i != "lo"]
        if any(not i.startswith(PREFIX) for i in ifaces):
            continue  # a namespace with anyone else's interface is never ours
        marked = [argv for _, argv, why in procs if why is not None]
        if ns in named:
            ours[ns] = named[ns]
        elif ifaces:
            ours[ns] = f"in a namespace holding {ifaces[0]}"
        elif marked:
            ours[ns] = f"in the namespace of {marked[0][-1][:40]}"
    return ours


def _our_processes() -> list[_Proc]:
    protected = _protected_pids()
    by_ns: dict[int, list[tuple[int, tuple[str, ...], str | None]]] = {}
    procs: list[tuple[int, tuple[str, ...], str | None, int | None]] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        raw = _read(f"/proc/{pid}/cmdline")
        if not raw:  # kernel threads and zombies have no command line
            continue
        argv = tuple(a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0"))
        ns, why = _netns_inode(pid), _argv_reason(argv)
        procs.append((pid, argv, why, ns))
        if ns is not None:
            by_ns.setdefault(ns, []).append((pid, argv, why))
    ours_ns = _our_namespaces(by_ns)
    found = []
    for pid, argv, why, ns in procs:
        reason = why or ours_ns.get(ns)  # type: ignore[arg-type]
        if reason is None or pid in protected or pid <= 1:
            continue
        start = start_ticks(pid)
        if start is not None:
            found.append(_Proc(pid, argv, start, ns, reason))
    return found


def _addressed() -> set[str]:
    """Interfaces of this namespace that hold an IPv4 address."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                         check=False).stdout
    return {line.split()[1] for line in out.splitlines() if len(line.split()) > 1}


def _our_links() -> list[str]:
    """Interfaces named ``tb*`` in this (the root) network namespace, but none holding an
    IPv4 address: the testbed never addresses its root-side interfaces, and such a one is
    how this machine is reached (a netns server's veth, which its own ssh session uses; it
    goes with its namespace)."""
    try:
        names = os.listdir("/sys/class/net")
    except OSError:
        return []
    ours = [n for n in names if n.startswith(PREFIX)]
    if not ours:
        return []
    addressed = _addressed()
    return sorted(n for n in ours if n not in addressed)


def _ovs_dbs() -> list[str]:
    """OVS database sockets we can reach: the system one and any under the testbed run folder."""
    if shutil.which("ovs-vsctl") is None:
        return []
    socks = [DEFAULT_OVS_DB] + sorted(glob.glob(f"{RUN_DIR}/**/db.sock", recursive=True))
    return [s for s in socks if os.path.exists(s)]


def _vsctl(db: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ovs-vsctl", f"--db=unix:{db}", "--timeout=3", *args],
                          capture_output=True, text=True, check=False)


def _our_ovs_bridges() -> list[tuple[str, str]]:
    found = []
    for db in _ovs_dbs():
        res = _vsctl(db, "list-br")
        if res.returncode == 0:
            found += [(db, b) for b in res.stdout.split() if b.startswith(PREFIX)]
    return found


#: the kinds of job folders a run makes in its run folder, one per job (job_dir(kind))
JOB_KINDS = ("coll", "train", "torch")


def job_dir(run_dir: str, kind: str, seq: int) -> str:
    """Path of this process's job folder ``<kind>-<pid>-<seq>`` under ``run_dir`` (not made)."""
    if kind not in JOB_KINDS:
        raise ValueError(f"job_dir kind must be one of {JOB_KINDS}, got {kind!r}")
    return os.path.join(run_dir, f"{kind}-{os.getpid()}-{seq}")


def remove_job_dirs(run_dir: str, pid: int | None = None) -> list[str]:
    """Remove the job folders of process ``pid`` (default this one) under ``run_dir``; the
    paths removed. A network's teardown calls it: a Ctrl-C that lands between a folder's
    making and the ``try`` that removes it must not leave the folder behind."""
    pid = os.getpid() if pid is None else pid
    gone = []
    for kind in JOB_KINDS:
        for path in glob.glob(os.path.join(run_dir, f"{kind}-{pid}-*")):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


def temp_dir(kind: str) -> str:
    """A new folder in the system temporary folder that ``testbed cleanup`` knows as ours;
    whoever makes it removes it when done (cleanup only catches what a dead run left)."""
    if kind not in TEMP_KINDS:
        raise ValueError(f"temp_dir kind must be one of {TEMP_KINDS}, got {kind!r}")
    return tempfile.mkdtemp(prefix=f"{PREFIX}-{kind}-")


def _listening_sockets() -> set[str]:
    """Paths of the Unix sockets bound by a live process (from /proc/net/unix)."""
    raw = _read("/proc/net/unix") or b""
    return {line.split()[-1].decode(errors="replace") for line in raw.splitlines()[1:]
            if len(line.split()) > 7}


def _our_files() -> list[str]:
    """Files and folders of ours (see the module docstring), as paths."""
    found = []
    try:
        names = sorted(os.listdir(RUN_DIR))
    except OSError:
        names = []
    lock = os.path.abspath(LOCK_PATH)
    bound = None
    for name in names:
        path = os.path.join(RUN_DIR, name)
        if path == lock:
            continue
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if stat.S_ISSOCK(mode):
            bound = _listening_sockets() if bound is None else bound
            if path in bound:
                continue  # a service not tied to a network (a planning-only provider)
        found.append(path)
    tmp = tempfile.gettempdir()
    prefixes = tuple(f"{PREFIX}-{k}-" for k in TEMP_KINDS)
    try:
        found += sorted(os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith(prefixes))
    except OSError:
        pass
    return found


def _remove_path(path: str) -> str | None:
    """Remove a file or a folder tree; its error text, or None when it is gone."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        return f"{path}: {e.strerror}"
    return None


def leftovers() -> dict[str, list[str]]:
    """What the testbed created that exists right now, by kind (each a list of descriptions).

    Only meaningful while holding the emulation lock: otherwise a live network of another
    run shows up too. All lists empty means the machine is clean.
    """
    return {
        "ovs_bridges": [b for _, b in _our_ovs_bridges()],
        "processes": [p.describe() for p in _our_processes()],
        "links": _our_links(),
        "netns": _named_netns(),
        "files": _our_files(),
    }


def _alive(p: _Proc) -> bool:
    return start_ticks(p.pid) == p.start


def _signal(p: _Proc, sig: int) -> None:
    if _alive(p):  # the pid still names the same process (not a reused one)
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass


def _kill(procs: list[_Proc], grace: float = 2.0) -> list[str]:
    """SIGTERM (SIGKILL for Mininet shells, which ignore it), then SIGKILL what is still alive."""
    for p in procs:
        _signal(p, signal.SIGKILL if p.why == "Mininet node shell" else signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        _signal(p, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p.describe() for p in procs]


def _run(cmd: list[str]) -> str | None:
    """Run a command; return its error text, or None when it worked."""
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return None if res.returncode == 0 else (res.stderr.strip() or f"exit {res.returncode}")


def _remove_all(errors: list[str], files: bool = True) -> dict[str, list[str]]:
    removed: dict[str, list[str]] = {k: [] for k in KINDS}
    # OVS first, while a daemon of ours is still there to remove its own taps.
    for db, br in _our_ovs_bridges():
        res = _vsctl(db, "--if-exists", "del-br", br)
        if res.returncode == 0:
            removed["ovs_bridges"].append(br)
        else:
            errors.append(f"ovs-vsctl del-br {br}: {res.stderr.strip()}")
    # Processes before links: killing a host's processes frees its namespace and its veths.
    # Killing a shell can orphan children into a namespace found only now: a few rounds.
    for _ in range(3):
        procs = _our_processes()
        if not procs:
            break
        removed["processes"] += _kill(procs)
    for name in _named_netns():
        err = _run(["ip", "netns", "delete", name])
        if err is None or not os.path.exists(f"/run/netns/{name}"):
            removed["netns"].append(name)
        else:
            errors.append(f"ip netns delete {name}: {err}")
    for name in _our_links():
        err = _run(["ip", "link", "delete", "dev", name])
        # Deleting one end of a veth also deletes its peer: gone is what counts.
        if err is None or not os.path.exists(f"/sys/class/net/{name}"):
            removed["links"].append(name)
        else:
            errors.append(f"ip link delete {name}: {err}")
    for path in _our_files() if files else ():  # last: killed processes write no more
        err = _remove_path(path)
        if err is None:
            removed["files"].append(path)
        else:
            errors.append(f"remove {err}")
    return removed


def busy_holder(path: str = LOCK_PATH) -> str | None:
    """Who holds the emulation lock right now ('pid N (command)'), or None when it is free.

    Call it before taking the lock (a holder in this very process also reads as busy).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return lock_holder(path)
    finally:
        os.close(fd)


def lock_file_pid(path: str = LOCK_PATH) -> int | None:
    """The pid the last holder of the emulation lock wrote into it (it may be dead)."""
    raw = _read(path)
    pid = raw.decode().strip() if raw else ""
    return int(pid) if pid.isdigit() else None


def lock_holder(path: str = LOCK_PATH) -> str:
    """Who holds the emulation lock, as 'pid N (command)' from the pid its holder wrote."""
    pid = lock_file_pid(path)
    if pid is None:
        return "an unknown process"
    cmd = (_read(f"/proc/{pid}/cmdline") or b"").replace(b"\0", b" ").decode(errors="replace")
    return f"pid {pid} ({cmd.strip()[:120] or 'exited'})"


def cleanup(force: bool = False, wait: float = 10.0, files: bool = True
            ) -> dict[str, list[str]]:
    """Remove every testbed leftover; return what was removed by kind, plus ``errors``.

    Holds the emulation lock (waiting up to ``wait`` seconds) so a live network is never torn
    down; ``force=True`` skips the lock (for a caller that holds it). ``files=False`` leaves
    the run folder's and temporary folder's files (a new network's own are there). Raises
    ``EmulationBusy`` naming the holder when the lock stays busy, ``PermissionError`` when
    not root.
    """
    if os.geteuid() != 0:
        raise PermissionError("testbed cleanup needs root (it deletes interfaces and kills "
                              "processes): run 'sudo make cleanup' or 'sudo .venv/bin/testbed "
                              "cleanup'")
    errors: list[str] = []
    if force:
        removed = _remove_all(errors, files)
    else:
        try:
            with emulation_lock(timeout=wait, guard=False):
                removed = _remove_all(errors, files)
        except EmulationBusy:
            raise EmulationBusy(
                f"a testbed network is running: the emulation lock is held by {lock_holder()} "
                f"(waited {wait:.0f} s). Let it finish, or use 'testbed cleanup --force' to tear "
                "it down anyway") from None
    return {**removed, "errors": errors}


def main(force: bool = False, clean=None) -> int:
    """CLI entry: clean up, print a table of what was removed; exit 0 when all went.
    ``clean``: what cleans instead of :func:`cleanup`, returning (this machine's result,
    server name -> report), e.g. :func:`testbed.topologies.cluster.cleanup_servers` for the
    servers of a cluster network."""
    from rich.console import Console
    from rich.table import Table

    console, err = Console(), Console(stderr=True)
    try:
        result, remote = clean() if clean is not None else (cleanup(force=force), {})
        for name, text in remote.items():
            console.print(f"[bold]{name}:[/bold] {text}")
    except (PermissionError, EmulationBusy) as exc:
        err.print(f"[red]testbed cleanup:[/red] {exc}")
        return 1 if isinstance(exc, PermissionError) else 2
    rows = [(kind, item) for kind in KINDS for item in result[kind]]
    if not rows:
        console.print("testbed cleanup: nothing to remove")
    else:
        table = Table(title="testbed cleanup: removed")
        table.add_column("kind")
        table.add_column("what")
        for kind, item in rows:
            table.add_row(kind, item)
        console.print(table)
    for e in result["errors"]:
        err.print(f"[red]could not remove:[/red] {e}")
    return 1 if result["errors"] else 0
