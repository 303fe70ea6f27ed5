"""The SLURM engine: ranks on the nodes of a SLURM allocation.

SLURM starts the processes, nblaunch never does it by ssh: one ``srun`` step
runs an nblaunch agent (:mod:`nblaunch.engines.agent`) on each node, and each agent
starts its node's ranks and talks to the kernel over the authenticated
channel (:mod:`nblaunch.wire.link`). The kernel may run inside the allocation (a
Jupyter server started by ``sbatch``/``salloc``, Open OnDemand, batchspawner):
its nodes are used. Outside one, :class:`Slurm` with ``nodes`` asks SLURM for
an allocation (``salloc --no-shell``), shows its state while it is pending,
and gives it back (``scancel``) when the launch or the live ranks end; with
``min_nodes``, a lost node's place is asked for too (:mod:`.slurm_spares`).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from typing import Callable, Optional

from .agent_engine import AgentEngine
from .slurm_spares import Replacement, Spares, minutes_left
from .slurm_steps import Steps
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
        self._spares: Optional[Spares] = None  # replacements for lost nodes, in an allocation of ours
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
        args = self._salloc_args(self._want, "nblaunch", self.spec.time)
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

    def _salloc_args(self, nodes: int, name: str, time_limit: Optional[str], exclude: tuple = ()) -> list[str]:
        args = [_slurm_command("salloc"), "--no-shell", f"--nodes={nodes}", f"--job-name={name}"]
        if self.spec.partition:
            args.append(f"--partition={self.spec.partition}")
        if time_limit:
            args.append(f"--time={time_limit}")
        if exclude:
            args.append(f"--exclude={','.join(exclude)}")
        if self.config.min_nodes is not None:
            args.append("--no-kill")  # a lost node must not end the allocation the others go on in
        return args + list(self.spec.extra_args)

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
        """The next generations without ``names``; in an allocation nblaunch
        asked for, SLURM is asked for a node in the place of each (a lost
        replacement is given back: its one-node job went with it)."""
        kept = [i for i, h in enumerate(self.hosts) if h not in names]
        self.hosts, self.addrs = [self.hosts[i] for i in kept], [self.addrs[i] for i in kept]
        if not self._ours or self.config.min_nodes is None:
            return  # inside the user's allocation only its nodes are used
        if self._spares is None:
            self._spares = Spares(self._ask_one)
        self._spares.lost(names)
        self._spares.ask(names, self.max_nodes - len(self.hosts), exclude=list(self._allocated))

    def _ask_one(self, instead_of: str, exclude: list[str]) -> Replacement:
        """``salloc`` for one node in the background: the time the allocation has left, none of ``exclude``."""
        left = minutes_left(_job_fields(self._job))
        args = self._salloc_args(1, "nblaunch-spare", str(left) if left else self.spec.time, tuple(exclude))
        r = Replacement(args, without_slurm_vars(os.environ), instead_of, self._granted_node)
        deadline = time.monotonic() + 5.0  # its job id, said at once by salloc, is known before anything else
        while r.pending and r.job is None and time.monotonic() < deadline:
            time.sleep(0.05)
            r.poll()
        return r

    def _granted_node(self, job: str) -> tuple:
        fields = _job_fields(job)
        host = _run([_slurm_command("scontrol"), "show", "hostnames", fields["NodeList"]]).split()[0]
        return host, max(1, int(fields.get("NumCPUs", "1")))

    def _replacement_hosts(self) -> list[str]:
        return [r.host for r in self._spares.granted()] if self._spares is not None else []

    def spare(self) -> list[str]:
        """Nodes of the allocation not in use, and replacements granted and not in use yet."""
        return [h for h in self._allocated + self._replacement_hosts() if h not in self.hosts]

    def with_nodes(self, names: list[str]) -> None:
        """The next generations on ``names`` too: the allocation's nodes in its order,
        then replacements in the order granted; at ``max_nodes``, the requests and
        replacements left unused are given back."""
        hosts = [h for h in self._allocated + self._replacement_hosts() if h in self.hosts or h in names]
        self.hosts, self.addrs = hosts, [self._node_addr(h) for h in hosts]
        if self._spares is not None and len(self.hosts) >= self.max_nodes:
            self._spares.give_back(keep=self.hosts, why=f"the run is on its {self.max_nodes} nodes again")

    def node_label(self, name: str) -> str:
        return self._spares.label(name) if self._spares is not None else name

    def said(self) -> list:
        return self._spares.said() if self._spares is not None else []

    def usable(self, name: str) -> bool:
        """A step of ``true`` on the node, in the allocation: its slurmd is back and
        SLURM still counts it in the job (a node it found down is taken out of a
        ``--no-kill`` job, and then never comes back into it)."""
        job = (self._spares.job_of(name) if self._spares is not None else None) or self._job
        try:
            done = subprocess.run([_slurm_command("srun"), f"--jobid={job}", "--overlap", "--nodes=1",
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

    def agent_commands(self) -> list[list[str]]:
        """One ``srun`` step per job: the allocation's nodes, then each
        replacement's (a job of its own); one task per node, each an agent
        given the node's CPUs (``--overlap``: the kernel's own step, when it
        runs in one, keeps its share), numbered on from the step before."""
        mine = [h for h in self.hosts if h in self._allocated]
        steps = [(self._job, mine, self._cpus)] if mine else []
        steps += [(r.job, [r.host], r.cpus) for r in (self._spares.granted() if self._spares else [])
                  if r.host in self.hosts]
        commands, base = [], 0
        for job, hosts, cpus in steps:
            commands.append([
                _slurm_command("srun"), f"--jobid={job}", "--overlap", f"--nodes={len(hosts)}",
                f"--ntasks={len(hosts)}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}",
                f"--nodelist={','.join(hosts)}", "--kill-on-bad-exit=0", "--job-name=nblaunch-agents",
                *self.spec.srun_args, sys.executable, "-m", "nblaunch.engines.agent",
                "--node-var", "SLURM_PROCID", "--node-base", str(base), "--name-var", "SLURMD_NODENAME"])
            base += len(hosts)
        return commands

    @property
    def reach(self) -> str:
        """An address of the nodes' network: the kernel listens on its route to it."""
        return self.addrs[0]

    def start_agents(self, env: dict, log_path: str) -> Steps:
        """The ``srun`` step, its output to ``log_path``. The agents get the
        kernel's environment (srun's default ``--export=ALL``) without the
        kernel's own SLURM task variables, which would set srun's defaults
        (``SLURM_NTASKS=1`` from the kernel's step refuses two nodes)."""
        procs = []
        with open(log_path, "ab") as log:  # every step's output in the one log, as written
            for command in self.agent_commands():
                procs.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT, env={**without_slurm_vars(os.environ), **env},
                                              start_new_session=True))
        return Steps(procs, log_path)

    def close(self) -> None:
        """Stop probing; give back the allocation nblaunch asked for (the kernel's own is
        kept) and every replacement, a request still pending withdrawn."""
        super().close()
        if self._spares is not None:
            self._spares.close()
            self._spares = None
        if self._ours and self._job is not None:
            self._ours = False
            try:
                subprocess.run([_slurm_command("scancel"), self._job], capture_output=True,
                               timeout=SCONTROL_TIMEOUT_S)
            except (subprocess.TimeoutExpired, LaunchError):
                pass


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
