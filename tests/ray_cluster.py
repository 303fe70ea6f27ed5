"""A two-node Ray cluster on this machine (``ray start --head`` and a second
``ray start``, 2 CPUs each), for the Ray tests and ``bench/ray_vs_train.py``.

Ray binds the host's interface address, never loopback (it ignores
``--node-ip-address=127.0.0.1`` on Linux): the cluster's ports are open on
that address while it runs."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def start(temp_dir: str) -> str:
    """Stop any Ray here, start the two nodes; return the head's address."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    common = ["--num-cpus=2", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    stop()
    head = subprocess.run([RAY, "start", "--head", f"--port={port}", "--include-dashboard=false", *common],
                          capture_output=True, text=True, timeout=180)
    if head.returncode != 0:
        raise RuntimeError(f"ray start --head failed:\n{head.stdout}{head.stderr}")
    found = re.search(r"ray start --address='([^']+)'", head.stdout + head.stderr)
    address = found.group(1) if found else f"127.0.0.1:{port}"
    worker = subprocess.run([RAY, "start", f"--address={address}", *common], capture_output=True, text=True,
                            timeout=180)
    if worker.returncode != 0:
        stop()
        raise RuntimeError(f"ray start (the second node) failed:\n{worker.stdout}{worker.stderr}")
    return address


def stop() -> None:
    subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
