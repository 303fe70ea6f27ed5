"""Real training code in a rank behaves as under torchrun (issue: "a rank is a
rank, not a notebook"): checked in real kernels, with the real libraries,
under every start method."""
from __future__ import annotations

import html
import json
import re
import textwrap

import pytest

from conftest import Kernel, launch_processes, rows_updates, wait_gone, matrix, widget_html

pytestmark = pytest.mark.timeout(300)

# What a notebook user typically has before the launch cell: libraries that
# look at their surroundings when imported, and logging set up for the kernel.
NOTEBOOK_SETUP = """
import logging, sys, os
logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s")
import tqdm.auto, tqdm.notebook
import transformers.trainer
import pytorch_lightning
from nblaunch import notebook_launcher
assert hasattr(sys, "ps1") and os.environ.get("FORCE_COLOR") == "1"   # the kernel is one
"""


@pytest.fixture(scope="module")
def nb():
    k = Kernel()
    try:
        reply = k.execute(NOTEBOOK_SETUP, timeout=180)
        assert reply.error is None, reply.error
        yield k
    finally:
        k.shutdown()


def _value(reply) -> object:
    """The JSON the cell printed last (cells end with ``print(json.dumps(...))``)."""
    assert reply.error is None, "\n".join(reply.error.get("traceback", [])) if reply.error else ""
    return json.loads(reply.stdout.strip().splitlines()[-1])


LOOKS = """
def looks():
    import builtins, logging, multiprocessing, os, sys
    import IPython, tqdm.auto, tqdm.std, transformers.trainer, transformers.trainer_callback
    from transformers.utils.import_utils import is_in_notebook
    from lightning_fabric.utilities import imports as fabric_imports
    from pytorch_lightning.trainer.connectors import accelerator_connector
    root = logging.getLogger()
    return {
        "get_ipython": IPython.get_ipython() is None,
        "ps1": hasattr(sys, "ps1"),
        "ipython_builtins": [n for n in ("get_ipython", "__IPYTHON__", "display") if hasattr(builtins, n)],
        "stdout": [type(s).__module__ + "." + type(s).__name__ for s in (sys.stdout, sys.stderr)],
        "fds": [sys.stdout.fileno(), sys.stderr.fileno()],
        # torch's init_process_group wraps the excepthook it finds, as in a torchrun rank
        "hooks": [sys.displayhook is sys.__displayhook__,
                  sys.excepthook is sys.__excepthook__ or "_distributed_excepthook" in repr(sys.excepthook)],
        "shell_hooks": "Shell" in repr(sys.excepthook) + repr(sys.displayhook),
        "handler_streams": [h.stream is sys.stderr for h in root.handlers],
        "env": {k: os.environ.get(k) for k in ("FORCE_COLOR", "CLICOLOR_FORCE", "TERM", "MPLBACKEND",
                                               "JPY_PARENT_PID", "NBLAUNCH_LATE")},
        "start_method": multiprocessing.get_start_method(),
        "in_notebook": is_in_notebook(),
        "lightning_interactive": [fabric_imports._IS_INTERACTIVE, accelerator_connector._IS_INTERACTIVE],
        "hf_progress": transformers.trainer.DEFAULT_PROGRESS_CALLBACK.__name__,
        "tqdm_auto_is_notebook": "tqdm_notebook" in [c.__name__ for c in tqdm.auto.tqdm.__mro__]
                                 and hasattr(tqdm.notebook.tqdm_notebook, "container"),
        "notebook_bar_draws_text": _notebook_bar_text(),
    }

def _notebook_bar_text():
    import io, tqdm.notebook
    buf = io.StringIO()
    bar = tqdm.notebook.tqdm(range(3), file=buf, mininterval=0)
    for _ in bar:
        pass
    return "3/3" in buf.getvalue()
"""


@pytest.mark.parametrize("method", ["fork", *matrix("forkserver", "spawn")])
def test_a_rank_sees_what_a_torchrun_rank_sees(nb, method):
    reply = nb.execute(LOOKS + textwrap.dedent(f"""
        os.environ["NBLAUNCH_LATE"] = "set after the first launch"   # forkserver must see it too
        out = notebook_launcher(looks, num_processes=2, start_method="{method}", display="none")
        import json; print(json.dumps(out))
    """))
    for seen in _value(reply):
        assert seen["get_ipython"] and not seen["ps1"] and seen["ipython_builtins"] == []
        assert seen["stdout"] == ["_io.TextIOWrapper"] * 2 and seen["fds"] == [1, 2]
        assert seen["hooks"] == [True, True] and not seen["shell_hooks"]
        assert seen["handler_streams"] == [True]  # the notebook's basicConfig, on the rank's stderr
        assert seen["env"] == {"FORCE_COLOR": None, "CLICOLOR_FORCE": None, "TERM": "dumb",
                               "MPLBACKEND": None, "JPY_PARENT_PID": None,
                               "NBLAUNCH_LATE": "set after the first launch"}
        assert seen["start_method"] == "fork"  # what torchrun's ranks get on Linux
        assert seen["in_notebook"] is False
        assert seen["lightning_interactive"] == [False, False]
        assert seen["hf_progress"] == "ProgressCallback"
        assert seen["notebook_bar_draws_text"] is True


def _moving(updates, rank: int) -> list[float]:
    """The distinct fractions a rank's row showed while it was running."""
    seen = []
    for u in updates:
        if len(u.rows) > rank and u.rows[rank][0] == "running" and u.rows[rank][1] not in seen:
            seen.append(u.rows[rank][1])
    return seen


TQDM_LOOPS = """
def tqdm_loops(kind):
    import time
    from tqdm import tqdm as plain
    from tqdm.auto import tqdm as auto
    bar = plain if kind == "plain" else auto
    for epoch in bar(range(2), desc="epoch"):
        for i in bar(range(40), desc="batch", leave=False):
            time.sleep(0.02)
    return "done"
"""


@pytest.mark.parametrize("kind", ["plain", "auto"])
@pytest.mark.parametrize("method", ["fork", *matrix("forkserver", "spawn")])
def test_tqdm_bars_move_the_rows_and_leave_no_message_dumps(tmp_path, kind, method):
    console = tmp_path / "kernel-console.log"
    k = Kernel(console=str(console))
    try:
        assert k.execute(NOTEBOOK_SETUP, timeout=180).error is None
        reply = k.execute(TQDM_LOOPS + f'notebook_launcher(tqdm_loops, args=("{kind}",), num_processes=2, '
                                       f'start_method="{method}")')
        assert reply.error is None, reply.error
        updates = rows_updates(reply.outputs)
        for rank in (0, 1):
            assert len(_moving(updates, rank)) >= 4, [u.rows for u in updates]
        final = updates[-1].rows
        assert [r[0] for r in final] == ["finished", "finished"]
        assert all("epoch 2/2" in r[2] for r in final), final  # the outer bar, once the inner one closed
        assert any("epoch 1/2 \u00b7 batch" in u.rows[0][2] for u in updates)  # both bars while nested
        logged = " ".join(widget_html(reply.outputs))
        assert "epoch: 100%" in logged  # the closed outer bar's final line, once, in the log pane
        assert "\r" not in logged and "\x1b" not in logged
    finally:
        k.shutdown()
    server_log = console.read_text(errors="replace")
    assert "from fork" not in server_log and "IProgress" not in server_log, server_log[-3000:]
    assert len(server_log) < 2000, server_log[-3000:]


HF_TRAINER = """
def hf_train(outdir):
    import time, torch
    from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                              TrainingArguments)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, num_labels=2)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 256
        def __getitem__(self, i):
            ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long), "labels": int(ids[0] % 2)}

    class Slow(TrainerCallback):   # a step as long as a real one, so a person could watch it
        def on_step_end(self, *a, **k):
            time.sleep(0.05)

    args = TrainingArguments(output_dir=outdir, per_device_train_batch_size=4, max_steps=30, logging_steps=5,
                             report_to=[], save_strategy="no", use_cpu=True)
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Slow()]).train()
    return args.process_index
"""


@pytest.mark.parametrize("method", ["fork", *matrix("spawn")])
def test_hf_trainer_progress_and_loss_reach_the_row(nb, tmp_path, method):
    reply = nb.execute(HF_TRAINER + textwrap.dedent(f"""
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            os.environ[var] = "1"
        notebook_launcher(hf_train, args=({str(tmp_path)!r},), num_processes=2, start_method="{method}")
    """), timeout=240)
    assert reply.error is None, reply.error
    updates = rows_updates(reply.outputs)
    assert len(_moving(updates, 0)) >= 5, [u.rows[0] for u in updates]
    final = updates[-1].rows[0]
    assert final[0] == "finished" and "30/30" in final[2] and "loss=" in final[2], final
    logged = html.unescape(" ".join(widget_html(reply.outputs)))
    assert "'loss':" in logged  # the Trainer's own printed log lines still reach the pane
    assert "<svg class='nblaunch-chart'" in logged  # and its loss is charted


LIGHTNING = """
def lightning_fit(bar):
    import time, torch
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)
        def training_step(self, batch, _):
            time.sleep(0.03)
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss, prog_bar=True)
            return loss
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(160, 8, generator=g), torch.randn(160, 1, generator=g))
    # bar "default": Lightning's choice (RichProgressBar where rich is installed, as here)
    callbacks = [pl.callbacks.TQDMProgressBar()] if bar == "tqdm" else []
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
    return trainer.global_rank, trainer.world_size, trainer.global_step
"""


@pytest.mark.parametrize("method,bar", [("fork", "default"), ("fork", "tqdm"),
                                        *matrix(("spawn", "tqdm"), ("forkserver", "default"))])
def test_lightning_ddp_trains_with_lightning_imported_in_the_notebook(nb, method, bar):
    reply = nb.execute(LIGHTNING + textwrap.dedent(f"""
        out = notebook_launcher(lightning_fit, args=("{bar}",), num_processes=2, start_method="{method}")
        import json; print(json.dumps(out))
    """), timeout=240)
    assert _value(reply) == [[0, 2, 40], [1, 2, 40]]  # 160 samples / 2 ranks / batch 4, 2 epochs
    updates = rows_updates(reply.outputs)
    assert len(_moving(updates, 0)) >= 4, [u.rows[0] for u in updates]
    assert "Epoch 1" in updates[-1].rows[0][2], updates[-1].rows[0]
    if bar == "tqdm":
        assert any("train_loss=" in u.rows[0][2] for u in updates)  # the bar's postfix metrics


LOGGING = """
def logs(n):
    import logging
    for i in range(n):
        logging.getLogger("train").info("record %d", i)
    return n
"""


@pytest.mark.parametrize("method", ["fork", *matrix("forkserver", "spawn")])
def test_notebook_logging_reaches_the_rank_lines_and_log_files(nb, method):
    reply = nb.execute(LOGGING + textwrap.dedent(f"""
        out = notebook_launcher(logs, args=(3,), num_processes=2, start_method="{method}", display="text")
        print("FILES", [open(f).read().count("INFO:train:record") for f in out.log_files])
    """))
    assert reply.error is None, reply.error
    for rank in (0, 1):
        for i in range(3):
            assert f"[rank {rank}] INFO:train:record {i}" in reply.stdout, reply.stdout
    assert "FILES [3, 3]" in reply.stdout


def test_logging_flood_is_rate_limited_like_prints(nb):
    reply = nb.execute(LOGGING + textwrap.dedent("""
        out = notebook_launcher(logs, args=(5000,), num_processes=1, display="text")
        print("FILES", [open(f).read().count("INFO:train:record") for f in out.log_files])
    """))
    assert reply.error is None, reply.error
    assert "more lines not shown here" in reply.stdout and "FILES [5000]" in reply.stdout
    assert reply.stdout.count("INFO:train:record") < 5000


DATALOADER = """
import torch
class SlowDS(torch.utils.data.Dataset):       # defined in the notebook
    def __len__(self):
        return 64
    def __getitem__(self, i):
        import os, time
        time.sleep(0.005)
        return torch.tensor([i]), os.getpid()

def load(fail_at):
    import os, torch.distributed as dist
    loader = torch.utils.data.DataLoader(SlowDS(), batch_size=4, num_workers=2, persistent_workers=True)
    seen, pids = [], set()
    for epoch in range(2):
        for step, (x, pid) in enumerate(loader):
            seen += x.flatten().tolist()
            pids |= set(pid.tolist())
            if dist.get_rank() == 1 and step == fail_at:
                with open(os.environ["WORKERS_FILE"], "w") as f:
                    f.write(" ".join(map(str, pids)))
                raise RuntimeError("rank 1 gives up mid-epoch")
    return sorted(set(seen)) == list(range(64)), len(pids - {os.getpid()})
"""


@pytest.mark.parametrize("method", ["fork", *matrix("spawn", "forkserver")])
def test_dataloader_workers_over_a_notebook_dataset(nb, tmp_path, method):
    workers_file = tmp_path / "workers"
    reply = nb.execute(DATALOADER + textwrap.dedent(f"""
        os.environ["WORKERS_FILE"] = {str(workers_file)!r}
        out = notebook_launcher(load, args=(-1,), num_processes=2, start_method="{method}", display="none")
        import json; print(json.dumps(out))
    """))
    assert _value(reply) == [[True, 2], [True, 2]]

    reply = nb.execute(textwrap.dedent(f"""
        from nblaunch import WorkerError
        try:
            notebook_launcher(load, args=(3,), num_processes=2, start_method="{method}", display="none")
        except WorkerError as e:
            print(json.dumps([e.rank, str(e).splitlines()[0]]))
    """))
    assert _value(reply) == [1, "rank 1 raised RuntimeError: rank 1 gives up mid-epoch"]
    workers = [int(p) for p in workers_file.read_text().split()]
    assert len(workers) == 2
    assert wait_gone(workers, timeout=10) == []
    assert wait_gone(launch_processes(nb.pid), timeout=10) == []


COLOURS = """
def colours():
    import warnings
    from rich.console import Console
    Console().print("[bold red]rich says hi[/bold red]")
    print("\\x1b[35mpurple\\x1b[0m and \\x1b[1mbold\\x1b[0m")
    return "ok"
"""


@pytest.mark.parametrize("method", ["fork", *matrix("spawn")])
def test_coloured_output_shows_as_colour_never_as_escapes(nb, method):
    reply = nb.execute(COLOURS + f'notebook_launcher(colours, num_processes=1, start_method="{method}")')
    assert reply.error is None, reply.error
    shown = " ".join(widget_html(reply.outputs))
    assert "rich says hi" in shown and "\x1b" not in shown and "[1m" not in shown
    assert "<span style='color:#bc3fbc'>purple</span>" in shown
    assert "<span style='font-weight:bold'>bold</span>" in shown


ACCELERATE = """
def accel():
    import torch
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    return acc.num_processes, acc.process_index, acc.is_main_process
"""


@pytest.mark.parametrize("method", ["fork", *matrix("forkserver", "spawn")])
def test_accelerate_state_made_in_the_kernel_does_not_leak_into_ranks(nb, method):
    reply = nb.execute(ACCELERATE + textwrap.dedent(f"""
        import json
        from accelerate import PartialState
        assert PartialState().num_processes == 1    # the kernel's own, single-process state
        out = notebook_launcher(accel, num_processes=2, start_method="{method}", display="none")
        print(json.dumps(out))
    """))
    assert _value(reply) == [[2, 0, True], [2, 1, False]]


def test_every_line_of_accelerates_test_script_is_reachable_from_the_cell(tmp_path):
    k = Kernel()  # its own: the script checks which rank is main, and expects a fresh notebook
    try:
        _every_line(k, tmp_path)
    finally:
        k.shutdown()


def _every_line(nb, tmp_path):
    reply = nb.execute(textwrap.dedent(f"""
        import os
        from nblaunch import notebook_launcher
        os.chdir({str(tmp_path)!r})   # the script writes its check files in the working directory
        import json
        from accelerate.test_utils.scripts.test_script import main
        out = notebook_launcher(main, num_processes=2)
        lines = [l for f in out.log_files for l in open(f).read().splitlines() if l.strip()]
        print(json.dumps(lines))
    """), timeout=240)
    lines = _value(reply)
    assert len(lines) > 40
    shown = html.unescape(" ".join(widget_html(reply.outputs)))
    missing = [line for line in lines if line.strip() not in shown]
    assert missing == [], missing[:5]
    # ... and it ran distributed, not as one process per rank each believing
    # it is the main one (on CPU accelerate needs ACCELERATE_USE_CPU, as its
    # own launchers set; without it this test passed by a race, 1 time in 3).
    assert "Distributed environment: DistributedType.MULTI_CPU" in shown and "Num processes: 2" in shown


def _final_values(outputs: list) -> dict:
    """Each widget's last HTML value (comm id -> value)."""
    last = {}
    for msg in outputs:
        if msg["msg_type"] in ("comm_msg", "comm_open"):
            value = msg["content"]["data"].get("state", {}).get("value")
            if isinstance(value, str):
                last[msg["content"]["comm_id"]] = value
    return last


CHATTY = """
def chatty(n):
    import time
    import torch.distributed as dist
    time.sleep(0.5)  # long enough for the live widgets (a shorter launch shows its final view only)
    for i in range(n):
        print(f"line {i} of rank {dist.get_rank()}")
    return n
"""


def test_the_log_pane_keeps_thousands_of_lines_and_tells_ranks_apart(nb):
    reply = nb.execute(CHATTY + 'notebook_launcher(chatty, args=(1500,), num_processes=2)')
    assert reply.error is None, reply.error
    pane = "".join(v for v in _final_values(reply.outputs).values() if "class='nblaunch-log'" in v)
    text = html.unescape(re.sub(r"<[^>]+>", "", pane))
    for rank in (0, 1):
        assert all(f"[rank {rank}] line {i} of rank {rank}" in text for i in range(1500))
    assert "<span style='color:#1f77b4'>[rank 0]</span>" in pane  # each rank's tag in its chart colour
    assert "<span style='color:#d62728'>[rank 1]</span>" in pane
    # The pane is paged: no single update re-sent more than one page of lines.
    updates = [m["content"]["data"].get("state", {}).get("value") for m in reply.outputs
               if m["msg_type"] in ("comm_msg", "comm_open")]
    biggest = max(len(v) for v in updates if isinstance(v, str) and "class='nblaunch-log'" in v)
    assert biggest < 120 * 80, biggest  # ~65 bytes a line here


CARRIAGE = """
def carriage():
    import sys, time
    for i in range(30):
        sys.stdout.write(f"\\rdownloading {i + 1}/30")
        sys.stdout.flush()
        time.sleep(0.05)
    sys.stdout.write("\\n")
    print("x" * 100_000)      # one giant line
    return "ok"
"""


def test_a_line_rewritten_with_carriage_returns_shows_live_and_giant_lines_are_shortened(nb):
    reply = nb.execute(CARRIAGE + 'out = notebook_launcher(carriage, num_processes=1)\n'
                                  'print(len(open(out.log_files[0]).read()))')
    assert reply.error is None, reply.error
    values = widget_html(reply.outputs)
    live = [re.search(r"downloading (\d+)/30", v) for v in values if "opacity:0.75" in v]
    seen = {int(m.group(1)) for m in live if m}
    assert len(seen) >= 4, seen  # the current line moved while the rank wrote it
    pane = "".join(v for v in _final_values(reply.outputs).values() if "class='nblaunch-log'" in v)
    assert "downloading 30/30" in pane and "downloading 29/30" not in pane  # one line, as a terminal shows
    assert "[98,000 more characters in the log file]" in pane
    assert int(reply.stdout.split()[-1]) > 100_000  # the log file keeps the whole line


def test_the_kernel_names_what_a_forked_rank_must_change_so_the_rank_walks_nothing(monkeypatch):
    """A forked rank that walked every module and logger it inherited copied a
    page of the kernel's for each (5 MiB of each rank's own memory, measured
    in bench/run.py); the kernel names them before forking instead."""
    import logging
    import sys

    import pytorch_lightning  # noqa: F401  (defines and copies _IS_INTERACTIVE)

    from nblaunch.rank import env as rank_env

    handler = logging.StreamHandler(sys.stderr)
    named = logging.getLogger("nblaunch-test-kernel-logger")
    named.addHandler(handler)
    monkeypatch.setattr(named, "propagate", False)
    try:
        facts = rank_env.kernel_facts()
    finally:
        named.removeHandler(handler)
    assert "nblaunch-test-kernel-logger" in facts["loggers"]
    assert "lightning_fabric.utilities.imports" in facts["interactive_modules"]
    assert all(hasattr(sys.modules[name], "_IS_INTERACTIVE") for name in facts["interactive_modules"])
    assert "pytorch_lightning.trainer.connectors.accelerator_connector" in facts["interactive_modules"]


def slurm_view():
    import os

    import torch.distributed as dist
    from lightning_fabric.plugins.environments import SLURMEnvironment

    env = SLURMEnvironment()
    return {"rank": dist.get_rank(), "procid": os.environ["SLURM_PROCID"], "localid": os.environ["SLURM_LOCALID"],
            "ntasks": os.environ["SLURM_NTASKS"], "job": os.environ["SLURM_JOB_ID"],
            "lightning": (env.global_rank(), env.local_rank(), env.world_size(), env.node_rank())}


@pytest.mark.parametrize("method", ["fork", *matrix("spawn")])
def test_a_launch_inside_a_slurm_job_gives_each_rank_slurm_variables_that_agree_with_its_rank(monkeypatch, method):
    """A kernel inside `srun` has one task's variables (SLURM_PROCID=0,
    SLURM_NTASKS=1); ranks that inherited them all said rank 0 to Lightning."""
    from nblaunch import notebook_launcher

    for name, value in {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "jupyter", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                        "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "1",
                        "SLURM_NODELIST": "localhost"}.items():
        monkeypatch.setenv(name, value)
    views = notebook_launcher(slurm_view, num_processes=2, start_method=method, display="none")
    for rank, view in enumerate(views):
        assert view["rank"] == rank
        assert (view["procid"], view["localid"], view["ntasks"], view["job"]) == (str(rank), str(rank), "2", "4242")
        assert view["lightning"] == (rank, rank, 2, 0)
