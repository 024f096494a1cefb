"""engine_process=true: completions run in a core process; its crash is a 503 and a restart, not a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import httpx

from scripts.processes import http_server

BODY = {"inputs": "The game", "parameters": {"max_new_tokens": 8, "details": True}}


def core_pid(server_pid: int) -> int:
    pids = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout.split()
    cores = [int(p) for p in pids if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(cores) == 1, pids
    return cores[0]


def test_the_core_process_gives_the_threads_tokens(store):
    with http_server(store, models='["tiny-gpt"]') as (base, _):
        expected = httpx.post(f"{base}/generate", json=BODY, timeout=30)
    with http_server(store, models='["tiny-gpt"]', engine_process="true") as (base, proc):
        core_pid(proc.pid)  # the engine is in a process of its own
        got = httpx.post(f"{base}/generate", json=BODY, timeout=30)
    assert expected.status_code == 200, expected.text
    assert got.json() == expected.json()
    assert got.json()["details"]["generated_tokens"] == 8


def test_a_crashed_core_fails_its_requests_with_503_and_is_restarted(store):
    with http_server(store, models='["tiny-gpt"]', engine_process="true") as (base, proc):
        core = core_pid(proc.pid)
        os.kill(core, signal.SIGSTOP)  # the request below reaches the core and waits there
        result: dict = {}
        client = threading.Thread(
            target=lambda: result.setdefault("r", httpx.post(f"{base}/generate", json=BODY, timeout=30))
        )
        client.start()
        client.join(0.5)
        os.kill(core, signal.SIGKILL)
        client.join(30)
        r = result["r"]
        assert r.status_code == 503, r.text
        assert "engine core exited" in r.json()["error"]
        again = httpx.post(f"{base}/generate", json=BODY, timeout=60)
        assert again.status_code == 200, again.text
        assert core_pid(proc.pid) != core
