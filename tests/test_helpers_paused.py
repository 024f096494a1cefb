"""Helper processes (inductor's compile workers, their C++ compilers) stop while requests run."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from server.execution.compute_thread import ComputeThread, HelpersPaused, helper_processes


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]  # R, S, T (stopped), ...


def compile_worker() -> subprocess.Popen:
    """A process whose command line reads as inductor's compile worker's."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "torch/_inductor/compile_worker"])


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
    helper = compile_worker()
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
    helper = compile_worker()
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


def test_only_compile_helpers_are_helpers():
    other = subprocess.Popen(["sleep", "30"])  # e.g. a server a test started
    helper = compile_worker()
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "server.execution.compile_worker"])
    try:
        assert eventually(lambda: {helper.pid, ours.pid} <= set(helper_processes()))
        assert other.pid not in helper_processes()
    finally:
        for p in (helper, ours, other):
            p.kill()
            p.wait()
