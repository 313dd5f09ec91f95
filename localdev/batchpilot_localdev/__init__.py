"""The development stack: a real control plane, Prometheus, Envoy and runtime processes on one
machine (``make demo``, ``make up``, the end-to-end tests and drills).

Its own package, never in an image: the operator does not import it (an import contract), and
it finds the checkout it builds and reads (``.cache/``, ``hack/``, ``crds/``, ``manifests/``)
with :func:`checkout`.
"""

import os
import random
import socket
import threading
from pathlib import Path

CHECKOUT_ENV = "BATCHPILOT_CHECKOUT"
CHECKOUT_MARKERS = ("pyproject.toml", "hack/setup.sh", "crds/batchingpolicy.yaml")
"""Files that make a directory a batchpilot checkout."""


def checkout() -> Path:
    """The batchpilot checkout: ``$BATCHPILOT_CHECKOUT`` when set, else the nearest directory
    above this package that holds every one of :data:`CHECKOUT_MARKERS` (an editable install
    of a checkout, as ``hack/setup.sh`` makes). Raises with what to do when there is none."""
    given = os.environ.get(CHECKOUT_ENV)
    if given:
        root = Path(given).resolve()
        missing = [m for m in CHECKOUT_MARKERS if not (root / m).is_file()]
        if missing:
            raise RuntimeError(f"${CHECKOUT_ENV}={given} is not a batchpilot checkout (no {', '.join(missing)})")
        return root
    here = Path(__file__).resolve().parent
    for root in here.parents:
        if all((root / m).is_file() for m in CHECKOUT_MARKERS):
            return root
    raise RuntimeError(
        f"the development stack runs from a batchpilot checkout and {here} is in none: "
        f"install the checkout editable (bash hack/setup.sh) or set ${CHECKOUT_ENV}"
    )


# Ports handed out by this process; never handed out twice, so that two callers who have not yet
# bound theirs (the apiserver's, etcd's client and peer ports, picked together) cannot collide.
_HANDED_OUT: set[int] = set()
_LOCK = threading.Lock()
_FALLBACK_LOW = 20000


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the source ports of outgoing connections (Linux default 32768-60999)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _listen_range() -> tuple[int, int]:
    """Where :func:`free_port` picks from: below the ephemeral range, so that no outgoing connection
    (a test client, a scrape, a watch) is given the port between our pick and the server's bind.
    Picking with bind(("", 0)) instead lands in the ephemeral range, and a CI run lost etcd to exactly
    that race ("bind: address already in use" on a port free a moment before)."""
    low, high = _ephemeral_range()
    if low - 1 - _FALLBACK_LOW >= 2000:
        return _FALLBACK_LOW, low - 1
    if high + 1 + 2000 <= 65535:  # a kernel configured with a low ephemeral range: pick above it
        return high + 1, 65535
    return 0, 0


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, outside the kernel's ephemeral
    range and never returned before by this process."""
    low, high = _listen_range()
    with _LOCK:
        if high:
            rng = random.SystemRandom()
            for _ in range(200):
                port = rng.randint(low, high)
                if port not in _HANDED_OUT and _bindable(port):
                    _HANDED_OUT.add(port)
                    return port
        while True:  # no room outside the ephemeral range: let the kernel pick
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
