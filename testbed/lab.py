"""``testbed lab``: JupyterLab on the repository's notebooks/ folder.

Runs as root (the notebooks build emulated networks), so it passes ``--allow-root``; it never
opens a browser and listens on ``ip:port`` (0.0.0.0 by default, so the lab VM's forwarded
port 8888 reaches it). The URL with its access token is printed before JupyterLab starts.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def command(port: int, ip: str, token: str, root_dir: Path = NOTEBOOKS) -> list[str]:
    """The JupyterLab command line (same interpreter, so the testbed is importable)."""
    lab = Path(sys.executable).with_name("jupyter-lab")
    exe = [str(lab)] if lab.exists() else [sys.executable, "-m", "jupyterlab"]
    return exe + [
        "--allow-root",
        "--no-browser",
        f"--ip={ip}",
        f"--port={port}",
        "--ServerApp.port_retries=0",  # a busy port is an error, not a silent other port
        f"--ServerApp.root_dir={root_dir}",
        f"--IdentityProvider.token={token}",
    ]


def url(port: int, ip: str, token: str) -> str:
    """Where to point a browser (a wildcard address is reached through localhost)."""
    host = "127.0.0.1" if ip in ("0.0.0.0", "", "*") else ("[::1]" if ip == "::" else ip)
    return f"http://{host}:{port}/lab?token={token}"


def main(port: int = 8888, ip: str = "0.0.0.0") -> int:
    """CLI entry: print the URL, then replace this process with JupyterLab."""
    if not 0 < port < 65536:
        print(f"testbed lab: --port {port} is not a TCP port (1..65535)", file=sys.stderr)
        return 2
    if not NOTEBOOKS.is_dir():
        print(f"testbed lab: no notebooks folder at {NOTEBOOKS}", file=sys.stderr)
        return 1
    if importlib.util.find_spec("jupyterlab") is None:
        print("testbed lab: JupyterLab is not installed; run 'sudo make setup'", file=sys.stderr)
        return 1
    token = os.environ.get("TESTBED_LAB_TOKEN") or secrets.token_hex(24)
    print(f"JupyterLab on {NOTEBOOKS}\nopen: {url(port, ip, token)}", flush=True)
    if os.geteuid() != 0:
        print("(not root: notebooks that build networks will fail; use 'sudo make lab')",
              flush=True)
    cmd = command(port, ip, token)
    os.execv(cmd[0], cmd)  # JupyterLab takes over this process: Ctrl-C reaches it directly
    return 0  # not reached
