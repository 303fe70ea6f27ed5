"""Root-cause rules on failures as data (process-free: runs in milliseconds).
The same situations with real ranks are in tests/test_failures.py."""
from __future__ import annotations

from nblaunch.errors import Departure, RankFailure, WorkerError, blame_departures, collective_in, root_cause

GLOO_PEER_LOSS = (
    "Traceback (most recent call last):\n"
    '  File "/tmp/ipykernel_7/123.py", line 5, in train\n'
    "    dist.all_reduce(t)\n"
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81, in wrapper\n'
    "    return func(*args, **kwargs)\n"
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2955, in all_reduce\n'
    "    work.wait()\n"
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234\n"
)


def peer_lost(rank: int, when: float) -> RankFailure:
    return RankFailure(rank, "exception", when, exc_type="RuntimeError",
                       message="Connection closed by peer [127.0.0.1]:1234", remote_traceback=GLOO_PEER_LOSS)


def test_the_collective_is_read_from_the_traceback():
    assert collective_in(GLOO_PEER_LOSS) == "all_reduce"
    assert collective_in("Traceback ...\nValueError: no") is None


def test_a_rank_that_returned_while_its_peer_waited_is_the_cause():
    failures = blame_departures([peer_lost(0, 10.2)], [Departure(1, 10.0, "returned")])
    cause = root_cause(failures)
    assert cause.rank == 1 and cause.kind == "left"
    assert cause.summary() == "rank 1 returned while rank 0 was in all_reduce"
    err = WorkerError(failures)
    assert err.rank == 1 and str(err).startswith("rank 1 returned while rank 0 was in all_reduce")


def test_an_exit_0_becomes_the_cause_with_where_the_others_waited():
    exit0 = RankFailure(1, "exit", 10.5, exitcode=0)  # os._exit(0): seen by the kernel, maybe after the peer's error
    failures = blame_departures([peer_lost(0, 10.2), peer_lost(2, 10.3), exit0], [])
    cause = root_cause(failures)
    assert cause.rank == 1 and cause.exitcode == 0
    assert cause.summary() == "rank 1 exited (code 0) while ranks 0 and 2 were in all_reduce"
    assert len(failures) == 3


def test_the_first_to_leave_is_blamed():
    failures = blame_departures([peer_lost(0, 10.2)],
                                [Departure(2, 10.1, "returned"), Departure(1, 10.0, "exited (code 0)", exitcode=0)])
    assert root_cause(failures).summary() == "rank 1 exited (code 0) while rank 0 was in all_reduce"


def test_a_real_error_elsewhere_is_still_the_cause():
    crash = RankFailure(2, "signal", 10.1, signal=11)
    failures = blame_departures([peer_lost(0, 10.2), crash], [Departure(1, 10.0, "returned")])
    assert root_cause(failures) is crash


def test_ranks_that_returned_with_no_one_waiting_are_not_blamed():
    raised = RankFailure(0, "exception", 10.2, exc_type="ValueError", message="bad batch")
    assert blame_departures([raised], [Departure(1, 10.0, "returned")]) == [raised]
    assert blame_departures([], [Departure(1, 10.0, "returned")]) == []
