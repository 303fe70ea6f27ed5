"""Debugging a rank (issue 39) against debugging the cell itself, in one real kernel, one run.

The anchor is what the issue asks to match: pdb on a single-process cell
(``pdb.set_trace()`` in the cell, ``%debug`` after a plain exception), driven
the way JupyterLab drives it (jupyter_client, ``allow_stdin=True``). Every
other anchor (``torch.distributed.breakpoint`` in Jupyter, Ray's debugger,
debugpy in spawned children) does not open a prompt in the notebook at all.

1. ``breakpoint()`` -> its prompt in the cell: rank 1 of 2 prints the time
   and breaks; the time until the front end gets the ``input_request``
   (goal: within 1 s), against the same in the cell.
2. A command's round trip: ``p 1 + 1`` answered -> the next prompt, median
   of the commands of every try, rank against cell.
3. ``%debug`` after a failure -> its first prompt: a rank's ``WorkerError``
   (its frames rebuilt from its snapshot) against a plain exception in the cell.

    python bench/debugger.py            # 10 tries each, about a minute on 2 CPUs
    python bench/debugger.py --smoke    # 2 tries (CI)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import BenchKernel  # noqa: E402

SETUP = """
import time, torch, torch.distributed as dist
from nblaunch import notebook_launcher, WorkerError
def in_rank():
    if dist.get_rank() == 1:
        print('BREAK', time.time(), flush=True)
        breakpoint()
    dist.all_reduce(torch.ones(1))
def fails():
    secret = 41
    if dist.get_rank() == 1:
        raise ValueError(secret)
    dist.all_reduce(torch.ones(1))
def plain_fails():
    secret = 41
    raise ValueError(secret)
"""
IN_RANK = "notebook_launcher(in_rank, num_processes=2, display='none')"
# In the cell, pdb.set_trace(): ipykernel 7's breakpoint() is debugpy's,
# which does nothing unless JupyterLab's visual debugger is attached.
IN_CELL = "import pdb\nprint('BREAK', time.time(), flush=True)\npdb.set_trace()\nx = 1"
COMMANDS = 5


def session(k: BenchKernel, code: str, commands: int) -> dict:
    """Run ``code``, answer ``p 1 + 1`` ``commands`` times, then ``c``;
    return the first prompt's latency and the commands' round trips."""
    prompts: list[float] = []
    sent: list[float] = []
    out: list[str] = []

    def stdin(msg):
        prompts.append(time.time())
        answer = "p 1 + 1" if len(sent) < commands else "c"
        sent.append(time.time())
        k.kc.input(answer)

    def output(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    k.kc.execute_interactive(code, allow_stdin=True, stdin_hook=stdin, output_hook=output, timeout=120)
    text = "".join(out)
    broke = float(text.split("BREAK ", 1)[1].split()[0]) if "BREAK " in text else prompts[0]
    return {"first_prompt_s": prompts[0] - broke,
            "round_trips_s": [prompts[i + 1] - sent[i] for i in range(len(prompts) - 1)]}


def post_mortem(k: BenchKernel, failing: str) -> float:
    """Seconds from sending ``%debug`` after ``failing`` raised to its first prompt."""
    k.kc.execute_interactive(failing, output_hook=lambda msg: None, timeout=120)
    asked: list[float] = []

    def stdin(msg):
        asked.append(time.time())
        k.kc.input("q")

    t0 = time.time()
    k.kc.execute_interactive("%debug", allow_stdin=True, stdin_hook=stdin, output_hook=lambda msg: None, timeout=120)
    return asked[0] - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args(argv)
    repeats = 2 if a.smoke else a.repeats
    k = BenchKernel()
    try:
        k.run(SETUP)
        rank, cell, rank_pm, cell_pm = [], [], [], []
        for _ in range(repeats):  # alternating: the machine's load falls on both alike
            rank.append(session(k, IN_RANK, COMMANDS))
            cell.append(session(k, IN_CELL, COMMANDS))
            rank_pm.append(post_mortem(k, "notebook_launcher(fails, num_processes=2, display='none')"))
            cell_pm.append(post_mortem(k, "plain_fails()"))
    finally:
        k.close()
    med = statistics.median

    def summary(runs):
        return {"first_prompt_s": med(r["first_prompt_s"] for r in runs),
                "round_trip_s": med(t for r in runs for t in r["round_trips_s"])}

    result = {
        "repeats": repeats, "commands_per_try": COMMANDS,
        "rank": summary(rank), "cell": summary(cell),
        "post_mortem_open_s": {"rank": med(rank_pm), "cell": med(cell_pm)},
    }
    result["ratios"] = {
        "round_trip_rank_over_cell": result["rank"]["round_trip_s"] / result["cell"]["round_trip_s"],
        "post_mortem_open_rank_over_cell": result["post_mortem_open_s"]["rank"] / result["post_mortem_open_s"]["cell"],
    }
    print(json.dumps(result, indent=2))
    if not a.smoke:
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / "debugger.json").write_text(json.dumps(result, indent=2))
    ok = result["rank"]["first_prompt_s"] < 1.0
    print(f"breakpoint() in a rank -> its prompt: {result['rank']['first_prompt_s'] * 1000:.1f} ms (goal < 1 s): "
          f"{'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
