"""The stop button pressed at each line of a launch in turn
(tests/test_hygiene.py): ``python press_scan.py FIRST LAST EVERY``.

For N in ``range(FIRST, LAST, EVERY)``, a 2-rank launch of a sleeping
``fn`` gets SIGINT (as the kernel's interrupt: ``signal.raise_signal``,
so the handler runs where Python would run it) once its cell's thread has
run N lines of Python. Lines 1-3,500 or so cover the launch's start, up to
the ranks in ``fn``. Each launch must raise ``KeyboardInterrupt`` within
1.5 s, leave no process of its own 1 s later and no more open files, and
the next launch must work. Prints one JSON line per launch that did not,
then ``{"scanned": count}``.

It found the launch slot kept for good, the engine left counted in flight,
launch folders never pruned, a rank's pipe fds left open, a pool (its
zygote's pipes, its folder) lost as it was handed back, and live ranks'
session left in flight (all fixed; tests/test_hygiene.py presses at every
line of a launch and of ``nblaunch.start`` up to the ranks' start)."""
from __future__ import annotations

import dis
import json
import os
import signal
import sys
import time

from conftest import launch_processes, wait_gone
from nblaunch import notebook_launcher


def sleeper():
    time.sleep(600)


class PressAtLine:
    """SIGINT to this thread once it has run ``n`` lines of Python, raised
    where Python itself would run the handler: at the next check for
    signals from there (CPython checks as a function starts, as a call
    returns and at a loop's jump back), not at any instruction."""

    def __init__(self, n: int):
        self.n, self.seen, self.pressed, self.pending = n, 0, False, False
        self.where = ""  # file:line (function) where it was pressed
        self._last: dict = {}  # frame -> the offset of the instruction it ran last

    def _press(self, frame) -> None:
        self.pending, self.pressed = False, True
        self.where = f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
        signal.raise_signal(signal.SIGINT)  # its handler runs now, in this trace function

    def _trace(self, frame, event, arg):
        if self.pressed:
            return None
        if self.pending:
            if event in ("call", "return"):  # a function's start; a call's return, in its caller
                self._press(frame)
            elif event == "opcode":
                last = self._last.get(frame)
                self._last[frame] = frame.f_lasti
                if last is not None and _checks_after(frame.f_code, last):
                    self._press(frame)
            return self._trace
        if event == "line":
            self.seen += 1
            if self.seen == self.n:
                self.pending = True
                frame.f_trace_opcodes = True
                self._last[frame] = None
        return self._trace

    def __enter__(self):
        # Python's handler, as a kernel has it: a process started in the
        # background by a script inherits SIGINT ignored (the press would be lost).
        self._handler = signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        signal.signal(signal.SIGINT, self._handler)
        self._last.clear()  # its frames, and what their locals hold


_CHECKS: dict = {}


def _checks_after(code, offset: int) -> bool:
    """Python checks for signals once the instruction at ``offset`` is done:
    a call, or a jump back."""
    if code not in _CHECKS:
        _CHECKS[code] = {op.offset for op in dis.get_instructions(code)
                         if op.opname in ("CALL", "CALL_FUNCTION_EX", "JUMP_BACKWARD")}
    return offset in _CHECKS[code]


def main(first: int, last: int, every: int) -> None:
    notebook_launcher(lambda: 1, num_processes=2, display="none")  # warm: first-use imports and files
    open_files = len(os.listdir("/proc/self/fd"))
    scanned = 0
    for n in range(first, last, every):
        t0 = time.monotonic()
        raised = None
        with PressAtLine(n):
            try:
                notebook_launcher(sleeper, num_processes=2, display="none", timeout=30)
            except BaseException as exc:  # noqa: BLE001 - reported
                raised = type(exc).__name__
        took = time.monotonic() - t0
        left = wait_gone(launch_processes(os.getpid()), timeout=1.0)
        files = len(os.listdir("/proc/self/fd"))
        try:
            after = notebook_launcher(lambda: 1, num_processes=2, display="none", init_process_group=False)
        except BaseException as exc:  # noqa: BLE001 - reported
            after = type(exc).__name__
        if raised != "KeyboardInterrupt" or took > 1.5 or left or files > open_files + 2 or after != [1, 1]:
            print(json.dumps({"line": n, "raised": raised, "took": round(took, 2), "left": left,
                              "more_open_files": files - open_files, "next_launch": str(after)}), flush=True)
            open_files = max(open_files, files)
        scanned += 1
    print(json.dumps({"scanned": scanned}), flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
