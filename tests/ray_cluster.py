"""A two-node Ray cluster on this machine (``ray start --head`` and a second
``ray start``, 2 CPUs each), for the Ray tests and ``bench/ray_vs_train.py``.

Ray binds the host's interface address, never loopback (it ignores
``--node-ip-address=127.0.0.1`` on Linux). With ``netns``, the cluster runs
in a network namespace of its own whose only interface is loopback: Ray then
falls back to 127.0.0.1 and nothing of it is reachable from outside (the
tests' kernels join it there). Without, its ports are open on the host's
address while it runs."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
HEALTH_CHECKS = json.dumps({"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
                            "health_check_failure_threshold": 3})


def make_netns(name: str) -> bool:
    """A network namespace with only loopback (up); False where it cannot be made."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True)
    if made.returncode != 0:
        return False
    return subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], capture_output=True).returncode == 0


def drop_netns(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def start(temp_dir: str, netns: str | None = None) -> str:
    """Stop any Ray here, start the two nodes (in ``netns``, if given); return the head's address."""
    inside = ["ip", "netns", "exec", netns] if netns else []
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    common = ["--num-cpus=2", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    stop()
    # A node that dies is known within seconds (Ray's default: about 30 s), so a
    # test of a lost node places its next generation on the nodes still up.
    head = subprocess.run([*inside, RAY, "start", "--head", f"--port={port}", "--include-dashboard=false",
                           f"--system-config={HEALTH_CHECKS}", *common], capture_output=True, text=True, timeout=180)
    if head.returncode != 0:
        stop()  # what it started before it gave up (seen: a GCS server left running)
        raise RuntimeError(f"ray start --head failed:\n{head.stdout}{head.stderr}")
    found = re.search(r"ray start --address='([^']+)'", head.stdout + head.stderr)
    address = found.group(1) if found else f"127.0.0.1:{port}"
    worker = subprocess.run([*inside, RAY, "start", f"--address={address}", *common], capture_output=True, text=True,
                            timeout=180)
    if worker.returncode != 0:
        stop()
        raise RuntimeError(f"ray start (the second node) failed:\n{worker.stdout}{worker.stderr}")
    return address


def stop() -> None:
    subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


def add_node(address: str, temp_dir: str, netns: str | None = None):
    """One more node (``ray start --address``, 2 CPUs); its raylet (a psutil.Process)."""
    import psutil

    inside = ["ip", "netns", "exec", netns] if netns else []
    before = {p.pid for p in _raylets()}
    started = subprocess.run([*inside, RAY, "start", f"--address={address}", "--num-cpus=2", "--disable-usage-stats",
                              f"--temp-dir={temp_dir}"], capture_output=True, text=True, timeout=180)
    if started.returncode != 0:
        raise RuntimeError(f"ray start (one more node) failed:\n{started.stdout}{started.stderr}")
    new = [p for p in _raylets() if p.pid not in before]
    assert len(new) == 1, new
    return new[0]


def node_id(raylet) -> str:
    """The Ray node id (hex) of the node whose raylet this is."""
    found = re.search(r"--node_id=([0-9a-f]+)", " ".join(raylet.cmdline()))
    assert found, raylet.cmdline()
    return found.group(1)


def kill_node(raylet) -> None:
    """SIGKILL a node's raylet and everything under it (its workers, and
    what they started): the machine is gone."""
    import psutil

    procs = [raylet, *raylet.children(recursive=True)]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def _raylets():
    import psutil

    return [p for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet"]
