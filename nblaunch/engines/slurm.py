"""The SLURM engine: ranks on the nodes of a SLURM allocation.

SLURM starts the processes, nblaunch never does it by ssh: one ``srun`` step
runs an nblaunch agent (:mod:`nblaunch.engines.agent`) on each node, and each agent
starts its node's ranks and talks to the kernel over the authenticated
channel (:mod:`nblaunch.wire.link`). The kernel may run inside the allocation (a
Jupyter server started by ``sbatch``/``salloc``, Open OnDemand, batchspawner):
its nodes are used. Outside one, :class:`Slurm` with ``nodes`` asks SLURM for
an allocation (``salloc --no-shell``), shows its state while it is pending,
and gives it back (``scancel``) when the launch or the live ranks end.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

from .agent_engine import AgentEngine, AgentStep
from ..clusters import Slurm
from ..config import check_max_nodes
from ..errors import LaunchError

__all__ = ["Slurm", "SlurmEngine", "without_slurm_vars"]

SCONTROL_TIMEOUT_S = 30.0
PENDING_POLL_S = 1.0
PROBE_TIMEOUT_S = 10.0  # a step of `true` on a node that came back (srun to a dead slurmd may hang)


def _slurm_command(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"cluster='slurm' needs SLURM's `{name}` command, and it is not on this machine's "
                          "PATH. Run the notebook on a SLURM cluster's login or compute node.")
    return path


def _run(args: list[str]) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{' '.join(args)}` did not answer within {SCONTROL_TIMEOUT_S:.0f} s: "
                          "is slurmctld up?") from None
    if done.returncode != 0:
        raise LaunchError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _job_fields(job: str) -> dict[str, str]:
    text = _run([_slurm_command("scontrol"), "show", "job", "-o", job])
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


class SlurmEngine(AgentEngine):
    """The nodes of one allocation, and the ``srun`` step of agents on them."""

    name = "slurm"

    def __init__(self, config, live: bool = False):
        super().__init__(config, live)
        spec: Slurm = config.cluster
        num_nodes = config.num_nodes if config.num_nodes > 1 else None
        self.spec = spec
        _slurm_command("srun")
        self._job = spec.job or os.environ.get("SLURM_JOB_ID")
        self._ours = False  # the allocation was asked for by us: given back at close
        self._want = spec.nodes or num_nodes
        self.hosts: list[str] = []
        self.addrs: list[str] = []
        self._allocated: list[str] = []  # every node of the allocation, in its order
        self._cpus = 1
        if self._job is None and self._want is None:
            raise LaunchError(
                "cluster='slurm' runs ranks on the nodes of a SLURM allocation, and this kernel is not in "
                "one ($SLURM_JOB_ID is not set). Start the notebook inside an allocation (salloc, sbatch, "
                "Open OnDemand), or ask for one: cluster=nblaunch.Slurm(nodes=2, partition=..., time=...).")
        if self._job is not None:
            self._read_allocation()
        else:
            check_max_nodes(config.max_nodes, config.min_nodes, self._want, f"Slurm(nodes={self._want})")

    @property
    def num_nodes(self) -> int:
        return len(self.hosts) if self.hosts else int(self._want)

    @property
    def label(self) -> str:
        return f"SLURM job {self._job}"

    # -- the allocation ----------------------------------------------------------

    def allocate(self, notice: Callable[[str], None], tick: Callable[[], None]) -> None:
        """Have an allocation: the kernel's, or one asked for now (waiting,
        and saying so, while SLURM keeps it pending)."""
        if self._job is not None:
            return
        args = [_slurm_command("salloc"), "--no-shell", f"--nodes={self._want}", "--job-name=nblaunch"]
        if self.spec.partition:
            args.append(f"--partition={self.spec.partition}")
        if self.spec.time:
            args.append(f"--time={self.spec.time}")
        if self.config.min_nodes is not None:
            args.append("--no-kill")  # a lost node must not end the allocation the others go on in
        args += list(self.spec.extra_args)
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=without_slurm_vars(os.environ), start_new_session=True)
        said, last_poll, output = "", 0.0, bytearray()
        try:
            fd = proc.stdout.fileno()
            os.set_blocking(fd, False)
            while True:
                output += _read_ready(fd)
                found = re.search(rb"job allocation (\d+)", output)
                if found and self._job is None:  # known while still pending: cancelled if we stop waiting
                    self._job, self._ours = found.group(1).decode(), True
                if proc.poll() is not None:
                    output += _read_ready(fd)
                    break
                if self._job is not None and time.monotonic() - last_poll > PENDING_POLL_S:
                    last_poll = time.monotonic()
                    state = self._pending_state()
                    if state and state != said:
                        notice(f"waiting for {self.label}: {state}")
                        said = state
                tick()
                time.sleep(0.1)
        except BaseException:
            proc.kill()
            proc.wait()
            proc.stdout.close()
            self.close()
            raise
        proc.stdout.close()
        text = output.decode(errors="replace")
        found = re.search(r"job allocation (\d+)", text)
        if found:
            self._job, self._ours = found.group(1), True
        if proc.returncode != 0 or self._job is None:
            self.close()
            raise LaunchError(f"SLURM did not grant an allocation of {self._want} nodes: {text.strip()}")
        self._read_allocation()

    def _pending_state(self) -> str:
        try:
            fields = _job_fields(self._job)
        except LaunchError:
            return ""
        state, reason = fields.get("JobState", ""), fields.get("Reason", "None")
        return state + (f" ({reason})" if reason not in ("None", "(null)") else "")

    def _read_allocation(self) -> None:
        fields = _job_fields(self._job)
        if fields.get("JobState") != "RUNNING":
            raise LaunchError(f"{self.label} is {fields.get('JobState', 'unknown')}, not running: its nodes "
                              "cannot be used")
        hosts = _run([_slurm_command("scontrol"), "show", "hostnames", fields["NodeList"]]).split()
        want = self._want or len(hosts)
        if want > len(hosts):
            raise LaunchError(f"{want} nodes were asked for, and {self.label} has {len(hosts)} "
                              f"({', '.join(hosts)})")
        check_max_nodes(self.config.max_nodes, self.config.min_nodes, len(hosts), self.label)
        self._allocated, self.hosts = hosts, hosts[:want]
        self.addrs = [self._node_addr(h) for h in self.hosts]
        cpus, nodes = int(fields.get("NumCPUs", "1")), int(fields.get("NumNodes", "1"))
        self._cpus = max(1, cpus // max(1, nodes))

    def without(self, names: list[str]) -> None:
        kept = [i for i, h in enumerate(self.hosts) if h not in names]
        self.hosts, self.addrs = [self.hosts[i] for i in kept], [self.addrs[i] for i in kept]

    def spare(self) -> list[str]:
        return [h for h in self._allocated if h not in self.hosts]

    def with_nodes(self, names: list[str]) -> None:
        hosts = [h for h in self._allocated if h in self.hosts or h in names]
        self.hosts, self.addrs = hosts, [self._node_addr(h) for h in hosts]

    def usable(self, name: str) -> bool:
        """A step of ``true`` on the node, in the allocation: its slurmd is back and
        SLURM still counts it in the job (a node it found down is taken out of a
        ``--no-kill`` job, and then never comes back into it)."""
        try:
            done = subprocess.run([_slurm_command("srun"), f"--jobid={self._job}", "--overlap", "--nodes=1",
                                   "--ntasks=1", f"--nodelist={name}", "--job-name=nblaunch-probe", "true"],
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_TIMEOUT_S,
                                  env=without_slurm_vars(os.environ))
        except (subprocess.TimeoutExpired, OSError, LaunchError):
            return False
        return done.returncode == 0

    @staticmethod
    def _node_addr(host: str) -> str:
        """Where the node is reached: SLURM's ``NodeAddr`` (node names need not resolve)."""
        text = _run([_slurm_command("scontrol"), "show", "node", "-o", host])
        found = re.search(r"\bNodeAddr=(\S+)", text)
        return found.group(1) if found else host

    # -- the agents --------------------------------------------------------------

    def agent_command(self) -> list[str]:
        """One task per node, each an agent given the node's CPUs (``--overlap``:
        the kernel's own step, when it runs in one, keeps its share)."""
        return [_slurm_command("srun"), f"--jobid={self._job}", "--overlap", f"--nodes={self.num_nodes}",
                f"--ntasks={self.num_nodes}", "--ntasks-per-node=1", f"--cpus-per-task={self._cpus}",
                f"--nodelist={','.join(self.hosts)}", "--kill-on-bad-exit=0", "--job-name=nblaunch-agents",
                *self.spec.srun_args,
                sys.executable, "-m", "nblaunch.engines.agent", "--node-var", "SLURM_PROCID", "--name-var", "SLURMD_NODENAME"]

    @property
    def reach(self) -> str:
        """An address of the nodes' network: the kernel listens on its route to it."""
        return self.addrs[0]

    def start_agents(self, env: dict, log_path: str) -> "_Step":
        """The ``srun`` step, its output to ``log_path``. The agents get the
        kernel's environment (srun's default ``--export=ALL``) without the
        kernel's own SLURM task variables, which would set srun's defaults
        (``SLURM_NTASKS=1`` from the kernel's step refuses two nodes)."""
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(self.agent_command(), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env={**without_slurm_vars(os.environ), **env},
                                    start_new_session=True)
        return _Step(proc, log_path)

    def close(self) -> None:
        """Stop probing; give back an allocation nblaunch asked for (the kernel's own is kept)."""
        super().close()
        if self._ours and self._job is not None:
            self._ours = False
            try:
                subprocess.run([_slurm_command("scancel"), self._job], capture_output=True,
                               timeout=SCONTROL_TIMEOUT_S)
            except (subprocess.TimeoutExpired, LaunchError):
                pass


class _Step(AgentStep):
    """The agents' ``srun`` step, as the rank pool sees it."""

    what = "srun step"

    def __init__(self, proc: subprocess.Popen, log_path: str):
        self._proc, self._log = proc, log_path

    def poll(self) -> Optional[int]:
        return self._proc.poll()

    def output(self) -> str:
        try:
            with open(self._log, errors="replace") as f:
                return f.read()[-20000:]
        except OSError:
            return ""

    def news(self) -> str:
        """Why an agent vanished without a word: a cancelled step's agents
        get SIGKILL, and srun then says so."""
        try:
            self._proc.wait(1.0)
        except subprocess.TimeoutExpired:
            pass
        said = [line.strip() for line in self.output().splitlines()
                if "CANCELLED" in line or "error:" in line or "DUE TO" in line]
        return f"was ended by SLURM ({said[0]})" if said else ""

    def end(self, timeout: float) -> None:
        """The step ends when its agents do; one that does not is cancelled
        as srun is told to (SIGINT twice within a second: srun's own rule)."""
        proc = self._proc
        try:
            proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            pass
        for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except OSError:
                break
            try:
                proc.wait(0.5)
                return
            except subprocess.TimeoutExpired:
                continue
        proc.wait()


def _read_ready(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return b""


def without_slurm_vars(environ) -> dict:
    """The environment without SLURM's job and task variables (``SLURM_CONF``
    stays): what agents started on other nodes, by srun or by Ray, are given
    of the kernel's (a kernel inside a job has its own task's)."""
    return {k: v for k, v in environ.items()
            if not (k.startswith(("SLURM_", "SLURMD_", "SRUN_", "SALLOC_", "SBATCH_")) and k != "SLURM_CONF")}
