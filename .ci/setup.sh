#!/usr/bin/env bash
# Idempotent set-up: Debian packages the testbed needs, then .venv with the package installed
# editable plus the extras `make test` ([test], [torch], [distributed], [traces]) and `make lab` ([lab]) need, checked with
# `pip check`. On a ready machine it checks and returns in seconds. Needs no network but the
# Debian mirror and the Python package index.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
    echo "testbed set-up needs root (it installs Debian packages and builds network namespaces)." >&2
    echo "Run it as root: 'sudo make test' / 'sudo make demo', or use the lab VM: 'vagrant up && vagrant ssh'." >&2
    exit 1
fi

# Debian packages: mnexec (mininet), bridges, traffic tools, Open vSwitch (benchmark anchor),
# ssh (cluster networks and their one-machine test server), Chromium and its WebDriver (the
# browser test of `testbed lab`: the system browser, never a downloaded one).
DEB_PKGS=(mininet bridge-utils iperf3 iperf iputils-ping ethtool iproute2 openvswitch-switch
          tcpdump tshark psmisc procps kmod python3-venv python3-dev gcc make
          openssh-client openssh-server chromium chromium-driver)
missing=()
for p in "${DEB_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# Reinstall only when pyproject.toml changed since the last successful install (by content,
# so a touch or a checkout of the same file does not trigger one), or the install is broken.
stamp="$VENV/.testbed-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $(pwd)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VENV/bin/python" -c "import testbed.kernels" 2>/dev/null; then
    echo "setup: installing the testbed into $VENV (editable, with the test, lab, torch, distributed and traces extras)"
    "$VENV/bin/pip" install -q --upgrade pip
    # [torch] pins torch==2.13.0, the CPU wheel (192 MB; found in the machine's local wheel
    # store where there is one): the PyTorch client's tests run in CI; [distributed]: the
    # distributed sweeps' tests run a Dask LocalCluster
    "$VENV/bin/pip" install -q -e '.[test,lab,torch,distributed,traces]'
    # Conflicting requirements fail the set-up here rather than a test later.
    "$VENV/bin/pip" check
    echo "$want" > "$stamp"
fi

# Numba's on-disk cache (cache=True) is keyed on each function's own source file only: a kernel
# that calls a changed kernel in another file would load stale machine code (seen to segfault).
# Drop every cached kernel older than the newest Python source, so they recompile once.
newest=$(find kernels testbed topologies -name '*.py' -printf '%T@ %p\n' 2>/dev/null | sort -n | tail -1 | cut -d' ' -f2-)
if [ -n "$newest" ]; then
    stale=$(find kernels testbed topologies -path '*__pycache__*' \( -name '*.nbi' -o -name '*.nbc' \) ! -newer "$newest" -print -delete 2>/dev/null | wc -l)
    [ "$stale" -eq 0 ] || echo "setup: dropped $stale stale Numba cache files"
fi

# Say once what the first network run would pay: compiling the kernels its programs need.
if ! "$VENV/bin/python" -c "import sys; from testbed import warm; sys.exit(bool(warm.cold_families(f for f, _ in warm.families())))" 2>/dev/null; then
    echo "setup: the Numba kernels are not compiled yet: the first network compiles those it needs"
    echo "       (once; 1-3 CPU-minutes for all of them). 'make warm' compiles every one now."
fi
