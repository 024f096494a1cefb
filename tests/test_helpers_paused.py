"""Helper processes (inductor's compile workers, their C++ compilers) stop while requests run."""

from __future__ import annotations

import multiprocessing
import subprocess
import threading
import time

from server.compute import ComputeThread, HelpersPaused, helper_processes


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]  # R, S, T (stopped), ...


def eventually(check, timeout_s: float = 3.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_helpers_stop_while_the_compute_thread_works_and_go_on_after():
    compute = ComputeThread("test-compute")
    compute.start()
    helper = subprocess.Popen(["sleep", "30"])
    pause = HelpersPaused(compute, patience_s=10)
    threading.Thread(target=pause.run, daemon=True).start()
    release = threading.Event()
    try:
        assert eventually(lambda: compute.idle.is_set())
        assert state(helper.pid) != "T"
        job = compute.submit(release.wait)  # a request's work: the compute thread is busy until released
        assert eventually(lambda: state(helper.pid) == "T"), "the helper kept running beside a request"
        release.set()
        job.result(timeout=5)
        assert eventually(lambda: state(helper.pid) != "T"), "the helper stayed stopped after the request"
    finally:
        release.set()
        pause.resume()
        helper.kill()
        helper.wait()
        compute.stop()


def test_a_busy_server_still_gives_its_helpers_a_slice():
    compute = ComputeThread("test-compute")
    compute.start()
    helper = subprocess.Popen(["sleep", "30"])
    pause = HelpersPaused(compute, patience_s=0.3, slice_s=0.5)
    threading.Thread(target=pause.run, daemon=True).start()
    release = threading.Event()
    try:
        job = compute.submit(release.wait)  # busy for longer than the patience
        assert eventually(lambda: state(helper.pid) == "T")
        assert eventually(lambda: state(helper.pid) != "T"), "never resumed under endless load"
    finally:
        release.set()
        job.result(timeout=5)
        pause.resume()
        helper.kill()
        helper.wait()
        compute.stop()


def test_processes_started_by_multiprocessing_are_never_helpers():
    core = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(30,), daemon=True)
    core.start()
    helper = subprocess.Popen(["sleep", "30"])
    try:
        found = helper_processes()
        assert helper.pid in found
        assert core.pid not in found
    finally:
        helper.kill()
        helper.wait()
        core.kill()
        core.join()
