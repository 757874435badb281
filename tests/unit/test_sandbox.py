"""Docker sandbox (apprentice/infra/sandbox.py) on a real engine: hardening, and escape / abuse attempts.

Each abuse test asserts that the host is untouched and that the sandbox answers the next command
(or, where the limit had to kill it, that the failure is an ordinary result, never an exception).
Skips, with the reason in the summary, only where no engine answers: `.ci/run` starts one with
scripts/docker-engine.sh first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from apprentice.infra import sandbox as sb

OK, WHY = sb.engine_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"no Docker engine: {WHY}")


@pytest.fixture
def box():
    b = sb.Sandbox()
    yield b
    b.close()


class _C:
    def __init__(self, d):
        self.id = d["Id"]


def _containers() -> list:
    return [_C(d) for d in sb.list_containers()]


def test_sandbox_container_is_hardened(box):
    attrs = sb.client().api.inspect_container(box.container_id)
    hc, cfg = attrs["HostConfig"], attrs["Config"]
    assert hc["NetworkMode"] == "none" and hc["ReadonlyRootfs"] is True
    assert cfg["User"] == sb.SANDBOX_UID
    assert hc["Memory"] == box.limits.memory_mb << 20 and hc["MemorySwap"] == hc["Memory"]
    assert hc["PidsLimit"] == box.limits.pids and hc["NanoCpus"] == int(box.limits.cpus * 1e9)
    assert hc["CapDrop"] == ["ALL"] and "no-new-privileges" in hc["SecurityOpt"]
    assert set(hc["Tmpfs"]) == {"/work", "/tmp"}
    assert cfg["Labels"][sb.OWNER_LABEL] == sb.owner_id()
    r = box.run("id -u; cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max")
    assert r.output.split()[:2] == ["1000", str(box.limits.pids)], r


def test_sandbox_network_is_unreachable(box):
    r = box.run("nc -w 2 1.1.1.1 80 </dev/null; echo rc=$?; cat /proc/net/dev")
    assert "rc=0" not in r.output and "Network is unreachable" in r.output
    ifaces = {line.split(":")[0].strip() for line in r.output.splitlines()[3:] if ":" in line}
    assert ifaces == {"lo"}


def test_sandbox_cannot_write_outside_workdir(box):
    r = box.run("touch /etc/pwned; echo x > /bin/pwned; echo y > /pwned")
    assert r.output.count("Read-only file system") == 3 and r.exit_code != 0
    assert "pwned" not in box.run("ls / /etc /bin").output
    assert not os.path.exists("/pwned") and not os.path.exists("/etc/pwned")
    # the writable places are small tmpfs: filling one is an ordinary error, not a host disk
    r = box.run("head -c 64m /dev/zero > big; echo rc=$?; df -k /work | tail -1")
    assert "rc=1" in r.output and int(r.output.split()[-5]) <= box.limits.workdir_mb * 1024


def test_sandbox_cannot_read_host_files(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host-secret-5f3a\n")
    r = box.run(f"cat {secret}; cat /proc/1/root{secret}; ls /root; grep -rs host-secret-5f3a /etc /work /tmp")
    assert "host-secret-5f3a" not in r.output and r.exit_code != 0


def test_sandbox_fork_bomb_is_contained(box):
    before = len(os.listdir("/proc"))
    r = box.run("f(){ f|f& }; f; sleep 1; echo bombed", timeout=4)
    assert "can't fork" in r.output or r.exit_code != 0
    after = box.run("ps | wc -l; echo alive")
    assert after.output.split()[-1] == "alive" and int(after.output.split()[0]) < 10
    assert len(os.listdir("/proc")) - before < box.limits.pids  # nothing multiplied on the host


def test_sandbox_memory_hog_is_killed(box):
    t0 = time.perf_counter()
    r = box.run("awk 'BEGIN { s = \"xxxxxxxxxxxxxxxx\"; while (1) s = s s }'", timeout=20)
    assert r.exit_code != 0 and not r.timed_out and time.perf_counter() - t0 < 20
    assert box.run("echo alive").output.strip() == "alive"


def test_sandbox_infinite_loop_times_out(box):
    r = box.run("while :; do :; done", timeout=2)
    assert r.timed_out and r.exit_code == 137 and r.seconds < 2 + 5
    assert box.run("echo alive").output.strip() == "alive"


def test_sandbox_huge_output_is_truncated(box):
    r = box.run("yes abcdefgh | head -c 5000000; echo", timeout=5)
    assert r.truncated and r.output_bytes >= 5_000_000
    assert len(r.output.encode()) <= box.limits.output_bytes


def test_sandbox_no_process_outlives_its_command(box):
    box.run("sleep 300 & sleep 301 & nohup sleep 302 >/dev/null 2>&1 & echo started")
    r = box.run("ps -o args")
    assert "sleep 30" not in r.output


def test_sandbox_container_is_removed_on_close():
    b = sb.Sandbox()
    cid = b.container_id
    b.close()
    deadline = time.time() + 20
    while time.time() < deadline and any(c.id == cid for c in _containers()):
        time.sleep(0.2)
    assert not any(c.id == cid for c in _containers())


_CHILD = """
import sys, time
from apprentice.infra.sandbox import Sandbox
b = Sandbox()
b.run("echo ready")
print(b.container_id, flush=True)
time.sleep(600)
"""


def test_sandbox_kill9_of_owner_leaves_no_container():
    p = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    try:
        cid = p.stdout.readline().strip()
        assert cid and any(c.id == cid for c in _containers())
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    deadline = time.time() + 30  # the watchdog notices the closed pipe and removes the owner's containers
    while time.time() < deadline and any(c.id == cid for c in _containers()):
        time.sleep(0.3)
    assert not any(c.id == cid for c in _containers())


def test_sandbox_sweep_removes_containers_of_dead_owners():
    sb.ensure_image()
    dead = f"{sb.owner_id().rsplit(':', 2)[0]}:999999999:0"
    ct = sb.client().containers.create(sb.DEFAULT_IMAGE, ["sleep", "60"], labels={sb.LABEL: "1", sb.OWNER_LABEL: dead})
    mine = sb.Sandbox()
    try:
        assert sb.sweep_orphans() >= 1
        ids = {c.id for c in _containers()}
        assert ct.id not in ids and mine.container_id in ids  # a live owner's container stays
    finally:
        mine.close()
