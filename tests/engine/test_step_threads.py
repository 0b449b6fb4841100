"""Steps of a few tokens run with fewer torch threads than prefill chunks and large batches
(engine/step_threads.py), on the thread that runs the steps, and only when asked for: by
default every step gets every thread."""

from __future__ import annotations

import torch

from engine import step_threads
from engine.sampling_params import SamplingParams
from engine.step_threads import StepThreads, default_small_threads
from tests.engine.engine_harness import make_engine, random_prompts


def test_small_steps_get_the_small_count_set_before_every_step(monkeypatch):
    calls = []
    monkeypatch.setattr(step_threads, "set_team_threads", calls.append)
    threads = StepThreads(num_threads=4, small_threads=1, small_tokens=16)
    for tokens in (512, 3, 3, 16, 17, 17, 1):
        threads.before_step(tokens)
    # Every step, not only on a change: a library's first parallel op on the thread resets it.
    assert calls == [4, 1, 1, 1, 4, 4, 1]
    threads.set_num_threads(2)  # a core share took two threads back
    threads.before_step(512)
    threads.before_step(3)
    assert calls[-2:] == [2, 1]
    assert [default_small_threads(n) for n in (1, 2, 3, 8)] == [1, 2, 3, 8]


def test_the_engine_decodes_with_the_small_count_and_prefills_with_all(tiny_llama_dir):
    before = torch.get_num_threads()
    try:
        engine = make_engine(tiny_llama_dir, num_threads=2, small_step_threads=1)
        assert engine.step_threads is not None and engine.step_threads.small_threads == 1
        seen = []
        real_execute = engine.runner.execute_model

        def execute(sched, *args):
            seen.append((sched.total_num_scheduled_tokens, torch.get_num_threads()))
            return real_execute(sched, *args)

        engine.runner.execute_model = execute
        engine.add_request("r", random_prompts([40], seed=0)[0],
                           SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while engine.scheduler.running or engine.scheduler.waiting:
            engine.step()
        assert seen[0] == (40, 2)  # the prompt, all threads
        assert all(threads == 1 for tokens, threads in seen[1:]) and len(seen) == 4
    finally:
        torch.set_num_threads(before)


def test_equal_counts_or_no_thread_count_leave_torch_alone(tiny_llama_dir):
    before = torch.get_num_threads()
    try:
        assert make_engine(tiny_llama_dir, num_threads=2, small_step_threads=2).step_threads is None
        assert make_engine(tiny_llama_dir, num_threads=2).step_threads is None  # the default
        assert make_engine(tiny_llama_dir).step_threads is None
    finally:
        torch.set_num_threads(before)


def test_set_team_threads_sizes_this_threads_openmp_and_mkl_only():
    """A team of two on one thread (the engine's), one thread for a thread that starts later,
    and MKL's count follows OpenMP's there (MKL's BLAS reads its own: a float32 GEMM stayed
    on one thread in a team of two)."""
    import ctypes
    import os
    import threading

    before = torch.get_num_threads()
    seen: dict[str, int] = {}

    def mkl_threads() -> int | None:
        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                           "libtorch_cpu.so"))
        get = getattr(library, "MKL_Get_Max_Threads", None)
        return None if get is None else get()  # None: a torch without MKL

    def engine_thread() -> None:
        step_threads.set_team_threads(2)
        seen["engine"] = torch.get_num_threads()
        seen["engine_mkl"] = mkl_threads()
        later = threading.Thread(target=lambda: seen.__setitem__("later", torch.get_num_threads()))
        later.start()
        later.join()

    try:
        torch.set_num_threads(1)
        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        assert seen["engine"] == 2 and seen["later"] == 1
        assert seen["engine_mkl"] in (None, 2)
    finally:
        torch.set_num_threads(before)
