"""rose's CPU threads on a machine other programs share (rosetrainer/threads.py): a count
the user fixes is kept; "auto" computes on the cores the other programs leave, and takes
them back when they are free; the user is told what was chosen, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from rosetrainer import threads as threads_module
from rosetrainer.errors import RoseError
from rosetrainer.threads import Threads, other_runnable_threads, own_runnable_threads


@pytest.fixture
def auto_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No OMP_NUM_THREADS (the tests' workers set it), torch at 2 threads (a 2-core
    machine's default) and every sample taken at once; the count restored after."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads_module, "SAMPLE_EVERY_S", 0.0)
    monkeypatch.setattr(threads_module, "DECIDE_EVERY_S", 0.0)
    monkeypatch.setattr(threads_module, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def loads(monkeypatch: pytest.MonkeyPatch, values: list[float]) -> None:
    """other_runnable_threads answers these, one a sample (the last one from then on), and
    every `adapt` takes one sample itself instead of starting the sampling thread, so the
    test decides when a sample is taken."""
    answers = iter(values)
    last = [values[-1]]

    def sample() -> float:
        last[0] = next(answers, last[0])
        return last[0]

    monkeypatch.setattr(threads_module, "other_runnable_threads", sample)
    monkeypatch.setattr(threads_module, "start_sampling", lambda threads: threads.sample())


def test_auto_uses_every_core_while_they_are_free(auto_env, monkeypatch) -> None:
    loads(monkeypatch, [0])
    threads = Threads()
    threads.adapt()
    assert (threads.count, torch.get_num_threads()) == (2, 2)
    assert "--num-threads N or OMP_NUM_THREADS=N" in threads.describe()


def test_auto_gives_way_to_busy_programs_and_takes_the_cores_back(auto_env, monkeypatch) -> None:
    """Two busy programs on 2 cores: one thread (never zero); one busy program: one; gone:
    two again, once the moving average has followed them out."""
    loads(monkeypatch, [2, 2, 2, 1, 1, 1] + [0] * 20)
    threads = Threads()
    threads.adapt()
    assert torch.get_num_threads() == 1
    assert "(1 now" in threads.describe()
    seen = []
    for _ in range(25):
        threads.adapt()
        seen.append(torch.get_num_threads())
    assert seen[0] == 1 and seen[-1] == 2


def test_a_moment_of_load_does_not_flip_the_count(auto_env, monkeypatch) -> None:
    """One sample of 2 busy programs among idle ones: the smoothed count stays below one
    program, so the team keeps both cores."""
    loads(monkeypatch, [0, 0, 0, 2] + [0] * 5)
    threads = Threads()
    counts = set()
    for _ in range(9):
        threads.adapt()
        counts.add(torch.get_num_threads())
    assert counts == {2}


def test_a_program_busy_most_of_the_time_leaves_the_team_its_cores(auto_env, monkeypatch) -> None:
    """A program runnable most but not all of the time (5 samples in 6 here) leaves gaps
    worth a second thread; a program runnable in every sample takes its core."""
    loads(monkeypatch, ([1, 1, 1, 1, 1, 0] * 10))
    threads = Threads()
    counts = []
    for _ in range(60):
        threads.adapt()
        counts.append(torch.get_num_threads())
    assert counts[10:] == [2] * 50
    loads(monkeypatch, [1])
    for _ in range(20):
        threads.adapt()
    assert torch.get_num_threads() == 1


def test_a_client_woken_by_each_step_does_not_take_a_core(auto_env, monkeypatch) -> None:
    """A server's client wakes right after each step, to read the tokens the step sent,
    and sleeps while the next step computes: runnable at every step's end, and little of
    the time. The load is sampled by a thread of its own, apart from the steps, so the
    team keeps both cores (sampled between steps, the client was in every sample, and
    the server computed on one thread)."""
    client_reading = threading.Event()
    monkeypatch.setattr(
        threads_module, "other_runnable_threads", lambda: int(client_reading.is_set())
    )
    monkeypatch.setattr(threads_module, "SAMPLE_EVERY_S", 0.002)
    threads = Threads()
    counts = []
    for _ in range(40):  # steps of 10 ms
        client_reading.set()  # (the step's tokens are out: the client wakes)
        threads.adapt()
        client_reading.clear()
        counts.append(torch.get_num_threads())
        time.sleep(0.01)
    assert counts.count(2) >= 0.9 * len(counts), counts


def test_the_sampling_thread_ends_when_the_steps_do(auto_env, monkeypatch) -> None:
    """An `LLM` between two generate calls: no thread left sampling the load; the next
    step starts one again."""
    monkeypatch.setattr(threads_module, "SAMPLE_UNTIL_IDLE_S", 0.05)
    threads = Threads()
    threads.adapt()
    sampler = threads.sampler
    assert sampler is not None and sampler.is_alive()
    sampler.join(timeout=5)
    assert not sampler.is_alive()
    threads.adapt()
    assert threads.sampler is not sampler and threads.sampler.is_alive()


def test_a_fixed_count_is_kept_whatever_the_load(auto_env, monkeypatch) -> None:
    loads(monkeypatch, [2])
    threads = Threads(2)
    for _ in range(5):
        threads.adapt()
    assert torch.get_num_threads() == 2
    assert threads.describe().startswith("2, fixed by --num-threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert Threads().describe().startswith("2, fixed by OMP_NUM_THREADS")


def test_compiled_code_keeps_the_count_it_started_with(auto_env, monkeypatch) -> None:
    loads(monkeypatch, [2, 0, 0, 0, 0, 0, 0, 0])
    threads = Threads(follow_load=False)
    for _ in range(8):
        threads.adapt()
    assert torch.get_num_threads() == 1
    assert "for the load at the start" in threads.describe()


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, 100_000])
def test_a_count_out_of_range_is_refused(bad) -> None:
    """Below one, not an integer, or past 4 a core (100,000 threads crash OpenMP)."""
    with pytest.raises(RoseError, match=r"--num-threads must be an integer in \[1, \d+\]"):
        Threads(bad)


def test_the_bound_counts_the_cores_this_process_may_use(monkeypatch) -> None:
    """Under `taskset -c 0` one core is usable: 8 threads there only wait for each other
    (the bound counted the machine's cores)."""
    monkeypatch.setattr(threads_module, "usable_cores", lambda: 1)
    with pytest.raises(RoseError, match=r"--num-threads must be an integer in \[1, 4\]"):
        Threads(8)
    assert Threads(4).count == 4


@pytest.mark.parametrize("value", ["abc", "0", "-3"])
def test_an_omp_num_threads_that_is_no_count_leaves_auto_and_is_told(
    value, auto_env, monkeypatch
) -> None:
    """OpenMP ignores such a value: rose does too, and says so, instead of calling a count
    fixed that nothing fixed."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    loads(monkeypatch, [0])
    threads = Threads()
    assert threads.fixed_by is None and threads.follow_load
    assert threads.describe().startswith(f"OMP_NUM_THREADS={value!r} is not a count, so auto")
    monkeypatch.setenv("OMP_NUM_THREADS", "2,1")  # (a count per nesting level: the first)
    assert Threads().describe().startswith("2, fixed by OMP_NUM_THREADS")


def test_an_omp_num_threads_count_is_kept_as_given(auto_env, monkeypatch) -> None:
    """OMP_NUM_THREADS=3 computes on 3 threads, as --num-threads 3 does (torch had read 2
    here and rose kept torch's, calling it fixed by OMP_NUM_THREADS); a count past the
    --num-threads bound is held to it, and said; a Unicode digit ("²", a digit to
    str.isdigit but not to int) is no count, not a traceback."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    threads = Threads()
    threads.adapt()
    assert (threads.count, torch.get_num_threads()) == (3, 3)
    assert threads.describe().startswith("3, fixed by OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "100000,1")
    most = threads_module.MAX_THREADS_PER_CORE * 2  # (auto_env: 2 usable cores)
    threads = Threads()
    assert threads.count == most
    assert threads.describe().startswith(f"{most}, fixed by OMP_NUM_THREADS='100000,1' at its")
    monkeypatch.setenv("OMP_NUM_THREADS", "²")
    loads(monkeypatch, [0])
    assert Threads().describe().startswith("OMP_NUM_THREADS='²' is not a count, so auto")


def test_each_compute_thread_gets_the_count_from_its_first_adapt(auto_env, monkeypatch) -> None:
    """OpenMP's count is per thread: a Threads handed to another thread (rose-serve's
    engine thread) sets it there, and leaves the thread that made it alone."""
    loads(monkeypatch, [0])
    torch.set_num_threads(1)
    threads = Threads(2)
    seen = []

    def engine_thread() -> None:
        threads.adapt()
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=engine_thread)
    worker.start()
    worker.join()
    assert seen == [2] and torch.get_num_threads() == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_busy_programs_are_counted_and_this_process_is_not() -> None:
    """The kernel's runnable count, less this process's own runnable threads: two CPU
    loops beside this process are counted (a loop is runnable whether or not it holds a
    core), this process itself (the thread reading, at least) is not."""
    assert own_runnable_threads() >= 1
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        samples = []
        for _ in range(40):
            samples.append(other_runnable_threads())
            if sorted(samples)[len(samples) // 2] >= 2:  # (the loops have started)
                break
            os.sched_yield()
            threading.Event().wait(0.05)
        assert sorted(samples)[len(samples) // 2] >= 2, samples
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@pytest.mark.slow
def test_rose_generate_tells_what_it_chose_and_refuses_a_bad_count(tiny_run_dir) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    command = [sys.executable, "-m", "roseinfer.cli_generate", "--checkpoint-path",
               str(tiny_run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "3"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    told = [line for line in done.stderr.splitlines() if line.startswith("[roseinfer] threads:")]
    assert len(told) == 1 and "--num-threads N or OMP_NUM_THREADS=N" in told[0], done.stderr
    done = subprocess.run(
        [*command, "--num-threads", "0"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "[roseinfer] error: --num-threads must be an integer in [1, "
        f"{4 * threads_module.usable_cores()}] (4 per core at most: more only wait for each other), got 0"
    ]
