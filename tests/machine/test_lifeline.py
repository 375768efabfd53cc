"""Nothing the testbed starts outlives the process that owns its network (testbed.lifeline).

Unit tests use plain processes as owners; the network tests SIGKILL what users run (``testbed
run``, ``testbed up``, a Jupyter kernel, ``testbed provider serve``) and time how long their
networks take to disappear: processes, links, namespaces and files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from testbed import cleanup, lifeline, warm
from testbed.datapath.engine import COMPILING
from testbed.datapath.nodes import not_ready_reason

REPO = Path(__file__).resolve().parents[2]
#: how long a test waits for a dead owner's network to go (the target, 5 s, is measured by
#: hand on a loaded fat-tree; tests never assert a time: a loaded CI machine is slower)
GONE_WITHIN_S = 30.0


def _sleeper(*extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *extra],
                            env=env)


def _follower(owner: subprocess.Popen, ignore_term: bool = False) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import signal, sys, time
        from testbed.lifeline import follow_owner
        if {ignore_term}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        assert follow_owner() is not None
        print("following", flush=True)
        time.sleep(120)
    """)
    env = {**os.environ, lifeline.OWNER_ENV: lifeline.identity(owner.pid)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "following"
    return proc


@pytest.mark.parametrize("ignore_term", [False, True], ids=["sigterm", "ignores-sigterm"])
def test_a_follower_ends_when_its_owner_is_sigkilled(ignore_term):
    owner = _sleeper()
    follower = _follower(owner, ignore_term)
    try:
        assert follower.poll() is None  # a live owner keeps it running
        owner.kill()
        owner.wait()
        t0 = time.monotonic()
        code = follower.wait(timeout=30)
        # SIGTERM at once; a process that ignores it is ended after the grace period
        assert code == (3 if ignore_term else -signal.SIGTERM)
        print(f"follower gone {time.monotonic() - t0:.2f} s after its owner")
    finally:
        for p in (owner, follower):
            p.kill()
            p.wait()


def test_follow_owner_is_a_no_op_for_the_owner_itself_and_without_an_owner(monkeypatch):
    monkeypatch.delenv(lifeline.OWNER_ENV, raising=False)
    assert lifeline.follow_owner() is None
    monkeypatch.setenv(lifeline.OWNER_ENV, lifeline.identity())
    assert lifeline.follow_owner() is None


def test_wait_for_exit_sees_a_reused_pid_as_gone_and_can_be_stopped():
    me = lifeline.identity()
    pid, start = lifeline.parse_identity(me)
    assert lifeline.start_ticks(pid) == start
    assert lifeline.wait_for_exit(f"{pid}:{int(start) + 1}")  # same pid, another process
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert lifeline.wait_for_exit(me, stop) is False
    with pytest.raises(ValueError, match="PID:START"):
        lifeline.parse_identity("12")


def test_the_lock_holder_owns_what_it_starts_and_disarms_its_guardian(tmp_path, monkeypatch):
    from testbed.netlock import emulation_lock

    monkeypatch.delenv(lifeline.OWNER_ENV, raising=False)
    with emulation_lock(path=str(tmp_path / "lock")):
        assert os.environ[lifeline.OWNER_ENV] == lifeline.identity()
        guardian = lifeline._owned["guardian"].proc
        assert guardian.poll() is None
        argv = tuple(Path(f"/proc/{guardian.pid}/cmdline").read_bytes().decode()
                     .rstrip("\0").split("\0"))
        assert cleanup._argv_reason(argv) is None  # never taken for a node of the network
    # a clean release: it exits without cleaning (killed by the signal if it came before
    # the guardian's handler was set)
    assert guardian.wait(5) in (0, -signal.SIGTERM)
    assert lifeline.OWNER_ENV not in os.environ


def test_not_ready_reasons_say_what_the_engine_was_doing():
    assert "still compiling" in not_ready_reason(f"{COMPILING} ['aggregate']\n")
    assert "testbed warm" in not_ready_reason(f"{COMPILING} ['aggregate']\n")
    assert "not started" in not_ready_reason("")
    assert "did not open" in not_ready_reason(f"{COMPILING} ['forward']\nkernels ready in 1 s\n")


def test_ensure_stages_compiles_once_then_trusts_the_stamp(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(warm, "STAMP_PATH", tmp_path / "stamp.json")
    assert warm.ensure_stages(["forward"]) == ["stage forward"]
    assert "compiling the data-path kernels of stage forward" in capsys.readouterr().err
    assert warm.cold_families(["stage forward"]) == []

    def no_compile(*a, **k):
        raise AssertionError(f"compiled again: {a}")

    monkeypatch.setattr(warm.subprocess, "run", no_compile)
    assert warm.ensure_stages(["forward"]) == []  # warm: a few stats, no process
    monkeypatch.setattr(warm, "fingerprint", lambda: "changed sources")
    assert warm.cold_families(["stage forward"]) == ["stage forward"]


def test_warm_refuses_an_unknown_family(capsys):
    assert warm.main(["--only", "stage nosuch"]) == 2
    assert "no kernel family" in capsys.readouterr().err


# ---- files ----------------------------------------------------------------------------------

def test_job_folders_of_one_process_are_removed_and_only_theirs(tmp_path):
    mine = [cleanup.job_dir(str(tmp_path), k, 7) for k in cleanup.JOB_KINDS]
    other = tmp_path / f"coll-{os.getpid() + 1}-7"  # another process's job: not ours to remove
    stranger = tmp_path / f"cache-{os.getpid()}-7"  # not a job kind
    for d in [*map(Path, mine), other, stranger]:
        d.mkdir()
        (d / "job.json").write_text("{}")
    assert sorted(cleanup.remove_job_dirs(str(tmp_path))) == sorted(mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other.name, stranger.name])
    with pytest.raises(ValueError, match="job_dir kind"):
        cleanup.job_dir(str(tmp_path), "tmp", 1)


@pytest.mark.root_required
def test_cleanup_removes_run_files_and_temp_folders_but_the_lock_and_live_sockets():
    import socket

    from testbed.netlock import LOCK_PATH, emulation_lock

    with emulation_lock(guard=False):
        os.makedirs(f"{cleanup.RUN_DIR}/tb-srv97", exist_ok=True)
        Path(f"{cleanup.RUN_DIR}/tb-srv97/authorized_keys").write_text("ssh-ed25519 AAAA x\n")
        tmp = cleanup.temp_dir("net")
        Path(tmp, "tbh1.neigh").write_text("neigh add\n")
        live = socket.socket(socket.AF_UNIX)
        live_path = f"{cleanup.RUN_DIR}/tb-test-live.sock"
        live.bind(live_path)
        live.listen()
        try:
            files = cleanup.leftovers()["files"]
            assert f"{cleanup.RUN_DIR}/tb-srv97" in files and tmp in files
            assert live_path not in files and LOCK_PATH not in files
            removed = cleanup.cleanup(force=True)
            assert removed["errors"] == []
            assert not os.path.exists(f"{cleanup.RUN_DIR}/tb-srv97") and not os.path.exists(tmp)
            assert os.path.exists(live_path) and os.path.exists(LOCK_PATH)
        finally:
            live.close()
            os.unlink(live_path)
    with pytest.raises(ValueError, match="kind"):
        cleanup.temp_dir("other")


# ---- networks whose owner is SIGKILLed --------------------------------------------------------

STAR_FILE = """
name = "lifeline-{tag}"
seed = 1
[topology]
kind = "star"
n_hosts = 3
bw_mbps = 20
switch = "programmable"
[[jobs]]
algo = "ina"
nbytes = "4MiB"
repetitions = 50
"""


def _ours_running() -> dict[str, list[str]]:
    return {k: v for k, v in cleanup.leftovers().items() if v}


def _engines() -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"testbed.datapath.engine" in cmd:
            out.append(int(pid))
    return out


def _wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _kill_and_time(pid: int) -> tuple[float, dict]:
    """SIGKILL ``pid``; seconds until nothing of ours is left (or the wait ran out), and what
    was left then (printed: the time is a measurement, not a check)."""
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    left = _ours_running()
    while left and time.monotonic() - t0 < GONE_WITHIN_S:
        time.sleep(0.1)
        left = _ours_running()
    print(f"network gone {time.monotonic() - t0:.2f} s after its owner's SIGKILL")
    return time.monotonic() - t0, left


@pytest.fixture
def no_network():
    """Nothing of ours before (what an earlier test kept, an engine's log, goes); whatever a
    failed test leaves is removed after."""
    cleanup.cleanup(wait=60)
    yield
    cleanup.cleanup(wait=60)


def _popen_cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "testbed.cli", *args], cwd=REPO,
                            stdin=subprocess.DEVNULL, **kw)


@pytest.mark.mininet
def test_sigkilled_testbed_run_takes_its_network_along(no_network, tmp_path):
    exp = tmp_path / "star.toml"
    exp.write_text(STAR_FILE.format(tag="run"))
    err = open(tmp_path / "stderr", "w+")  # noqa: SIM115 - read after the kill
    proc = _popen_cli("run", str(exp), "--out", str(tmp_path / "res"), stdout=err, stderr=err)
    try:
        # mid-run: the engine serves and a collective's pool is running
        _wait_until(lambda: _engines() and any("testbed.collectives.worker" in p
                                               for p in cleanup.leftovers()["processes"]),
                    240, "the run's engine and a collective pool")
        _, left = _kill_and_time(proc.pid)
        assert left == {}, left
        err.seek(0)
        assert "died without tearing it down" in err.read()  # the guardian says what it did
    finally:
        proc.kill()
        proc.wait()
        err.close()


@pytest.mark.mininet
def test_sigkilled_testbed_up_takes_its_network_along_and_down_then_finds_none(no_network,
                                                                              tmp_path):
    exp = tmp_path / "star.toml"
    exp.write_text(STAR_FILE.format(tag="up"))
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "up", str(exp), "--detach"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    from testbed.up import read_state

    state = read_state()
    assert state and state["alive"] and _engines()
    _, left = _kill_and_time(int(state["pid"]))
    assert left == {}, left
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "down"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "no network is up" in r.stdout, r.stdout + r.stderr


@pytest.mark.mininet
def test_up_then_down_leaves_no_file(no_network, tmp_path):
    exp = tmp_path / "star.toml"
    exp.write_text(STAR_FILE.format(tag="updown"))
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "up", str(exp), "--detach"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert cleanup.leftovers()["files"]  # while up: its state, engine config and log
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "down"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _ours_running() == {}


@pytest.mark.mininet
def test_sigkilled_provider_serve_takes_its_network_along(no_network, tmp_path):
    exp = tmp_path / "star.toml"
    exp.write_text(STAR_FILE.format(tag="provider"))
    err = open(tmp_path / "stderr", "w+")  # noqa: SIM115 - read while it runs
    proc = _popen_cli("provider", "serve", str(exp), "--socket",
                      str(tmp_path / "provider.sock"), stdout=err, stderr=err)
    try:
        def serving() -> bool:
            err.seek(0)
            assert proc.poll() is None, err.read()
            return "serving at" in err.read()

        _wait_until(serving, 240, "the provider to serve")
        assert _engines()
        _, left = _kill_and_time(proc.pid)
        assert left == {}, left
    finally:
        proc.kill()
        proc.wait()
        err.close()


@pytest.mark.mininet
def test_sigkilled_notebook_kernel_takes_its_network_along(no_network):
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(REPO))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        code = ("from testbed.topologies import Star, TestbedNet\n"
                "net = TestbedNet(Star(3, switch='programmable', bw_mbps=20)).__enter__()\n"
                "print('network up', flush=True)")
        reply = kc.execute_interactive(code, timeout=300)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert _engines()
        _, left = _kill_and_time(km.provisioner.process.pid)
        assert left == {}, left
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.mininet
def test_a_new_network_removes_what_a_dead_one_left_and_says_so(no_network, capsys):
    from testbed.topologies import Star, TestbedNet

    # what a run killed together with its guardian leaves: a marked process, a root-side link
    stray = _sleeper("testbed-node=tbold")
    subprocess.run(["ip", "link", "add", "tbold0", "type", "veth", "peer", "name", "tbold1"],
                   check=True)
    try:
        with TestbedNet(Star(2, bw_mbps=20)) as net:
            assert net.pingall()["failed"] == []
        assert "a previous run left 1 processes, 2 links behind" in capsys.readouterr().err
        assert stray.wait(5) is not None
        assert not os.path.exists("/sys/class/net/tbold0")
    finally:
        stray.kill()
        stray.wait()
        subprocess.run(["ip", "link", "del", "tbold0"], capture_output=True)
