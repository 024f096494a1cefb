"""`make image-test`: build the server image's CPU variant without Docker and serve from inside it.

    python -m scripts.image_test [--tag localhost/tinyserve:cpu] [--rebuild-base]

1. A Debian bookworm base, made once with `debootstrap --variant=minbase` from the mirror apt already
   uses and imported as `localhost/debian:bookworm` (kept in podman's storage: later runs reuse it).
2. torch's CPU wheel, as pip resolves `torch==2.13.0` on this machine (`-c constraints.txt`), put in
   `build/wheels/` and bind-mounted into the build (`--build-arg WHEELS=/wheels`), so the image gets
   the CPU build instead of PyPI's CUDA one; the CA bundle pip trusts here goes in the same way.
3. `podman build --isolation chroot` of the Dockerfile on that base.
4. Inside the image (`buildah run`: `podman run` cannot start containers in this sandbox), the image's
   own command on a free port: wait for /health 200, complete a prompt, fill a mask, stop it; then
   torch.compile's CPU backend once (the compiled decode steps need the image's g++).
Prints the image size, the build time and the time to /health 200; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from scripts.processes import free_port, wait_healthy, wait_loaded

REPO = Path(__file__).resolve().parent.parent
BASE = "localhost/debian:bookworm"
BUILD = REPO / "build"


def sh(*cmd: str, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def apt_mirror() -> str:
    """The Debian mirror apt already uses (the `URIs:` line of its sources), else deb.debian.org."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        match = re.search(r"^URIs:\s*(\S+/debian)\s*$", path.read_text(), re.M)
        if match:
            return match.group(1)
    return "http://deb.debian.org/debian"


def ensure_tools() -> None:
    missing = [t for t in ("podman", "buildah", "debootstrap") if shutil.which(t) is None]
    if missing:
        sh("apt-get", "update", "-qq")
        sh("apt-get", "install", "-y", "-qq", "--no-install-recommends", "podman", "buildah", "debootstrap")


def ensure_base(rebuild: bool) -> None:
    if not rebuild and subprocess.run(["podman", "image", "exists", BASE]).returncode == 0:
        return
    with tempfile.TemporaryDirectory(dir=BUILD) as rootfs:
        sh("debootstrap", "--variant=minbase", "bookworm", rootfs, apt_mirror(), stdout=subprocess.DEVNULL)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):  # the packages it downloaded
            sh("find", f"{rootfs}/{cache}", "-type", "f", "-delete")
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        sh("podman", "import", "-", BASE, stdin=tar.stdout, stdout=subprocess.DEVNULL)
        if tar.wait() != 0:
            raise SystemExit("tar of the debootstrap root failed")


def stage_torch_wheel() -> Path:
    """The torch wheel pip picks here for the project's pin: on this machine, the CPU build."""
    wheels = BUILD / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels)]
    sh(*pip, "-c", str(REPO / "constraints.txt"), "torch==2.13.0")
    found = sorted(wheels.glob("torch-2.13.0*.whl"))
    if not any("+cpu" in w.name for w in found):
        raise SystemExit(f"no CPU wheel of torch 2.13.0 in {wheels}: {[w.name for w in found]}")
    return wheels


def ca_bundle() -> Path | None:
    """The CA bundle pip trusts here (PIP_CERT, else the system's), for a network whose proxy re-signs TLS."""
    for candidate in (os.environ.get("PIP_CERT"), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def build(tag: str, wheels: Path) -> float:
    args = ["--build-arg", f"BASE_IMAGE={BASE}", "--build-arg", "WHEELS=/wheels", "-v", f"{wheels}:/wheels:ro"]
    bundle = ca_bundle()
    if bundle:
        args += ["--build-arg", "CA_BUNDLE=/ca-bundle.crt", "-v", f"{bundle}:/ca-bundle.crt:ro"]
    start = time.monotonic()
    sh(
        "podman", "build", "--isolation", "chroot", "--format", "docker", *args, "-t", tag, str(REPO)
    )  # keeps HEALTHCHECK
    return time.monotonic() - start


def image_size(tag: str) -> int:
    image = json.loads(sh("podman", "image", "inspect", tag, capture_output=True, text=True).stdout)[0]
    healthcheck = image.get("Healthcheck") or image["Config"].get("Healthcheck") or {}
    if "/health" not in " ".join(healthcheck.get("Test", [])):
        raise SystemExit("the image has no HEALTHCHECK on /health")
    return int(image["Size"])


def check_compiler(tag: str) -> None:
    """torch.compile's CPU backend works inside the image (it needs the g++ the Dockerfile installs)."""
    probe = (
        "import torch; f = torch.compile(lambda x: x.sin() * 2); "
        "assert torch.allclose(f(torch.ones(8)), torch.ones(8).sin() * 2)"
    )
    container = sh("buildah", "from", "--pull-never", tag, capture_output=True, text=True).stdout.strip()
    try:
        sh("buildah", "run", "--isolation", "chroot", container, "--", "python", "-c", probe)
    finally:
        subprocess.run(["buildah", "rm", container], stdout=subprocess.DEVNULL)


def serve_and_check(tag: str) -> float:
    """The image's CMD with another port; returns seconds from start to /health 200."""
    config = json.loads(sh("podman", "image", "inspect", tag, capture_output=True, text=True).stdout)[0]["Config"]
    port = free_port()
    cmd = [*config["Cmd"][:-1], str(port)] if config["Cmd"][-2] == "--port" else config["Cmd"]
    container = sh("buildah", "from", "--pull-never", tag, capture_output=True, text=True).stdout.strip()
    log = open(BUILD / "image-test-server.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(
        ["buildah", "run", "--isolation", "chroot", container, "--", *cmd],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        ready = wait_healthy(base, server, 600, lambda: f"see {log.name}")
        body = {"inputs": "The castle was built in", "parameters": {"max_new_tokens": 24, "seed": 1, "do_sample": True}}
        completion = httpx.post(f"{base}/generate", json=body, timeout=120)
        completion.raise_for_status()
        print("completion:", repr(completion.json()["generated_text"]))
        print(f"every model loaded {wait_loaded(base, 120):.1f} s after /health 200")  # fill-mask: 503 before
        fill = httpx.post(f"{base}/fill-mask", json={"inputs": "Mi <mask> vin.", "variant": "both"}, timeout=120)
        fill.raise_for_status()
        for model, candidates in fill.json()["results"].items():
            print(f"fill-mask {model}:", ", ".join(c["token_str"].strip() for c in candidates))
        return ready
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
        subprocess.run(["buildah", "rm", container], stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="localhost/tinyserve:cpu")
    parser.add_argument("--rebuild-base", action="store_true", help="debootstrap the Debian base again")
    args = parser.parse_args()
    BUILD.mkdir(exist_ok=True)
    ensure_tools()
    start = time.monotonic()
    ensure_base(args.rebuild_base)
    base_s = time.monotonic() - start
    build_s = build(args.tag, stage_torch_wheel())
    size = image_size(args.tag)
    ready_s = serve_and_check(args.tag)
    check_compiler(args.tag)
    print(
        f"image-test passed: {args.tag} {size / 1e6:,.0f} MB; base {base_s:.0f} s (0 when cached), "
        f"build {build_s:.0f} s, /health 200 after {ready_s:.1f} s"
    )


if __name__ == "__main__":
    main()
