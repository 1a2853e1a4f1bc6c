"""A testbed leaves nothing behind: not on exit, not on an error, not on Ctrl-C."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fusionllm.node.local_swarm import wait_for
from fusionllm.testbed.bed import Testbed, leftovers
from fusionllm.testbed.topology import parse_topology

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(120)]

TWO = {"name": "two", "hosts": [{"name": "x", "cpu": 0.25}, {"name": "y"}]}


def _sleeper(bed: Testbed, host: str) -> psutil.Process:
    """A process in ``host`` that escaped its parent's tree (as a node's DHT worker may)."""
    parent = bed.popen(host, ["sh", "-c", "setsid sleep 300 & echo $!"], stdout=subprocess.PIPE)
    pid = int(parent.stdout.readline())
    parent.wait(10)
    return psutil.Process(pid)


def _gone(process: psutil.Process) -> bool:
    """Dead: gone, or a zombie its new parent (a subreaper) has not reaped yet."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_close_kills_every_process_in_the_hosts_and_removes_what_it_made():
    with Testbed(parse_topology(TWO)) as bed:
        escaped = _sleeper(bed, "x")
        tracked = bed.popen("y", ["sleep", "300"])
        emulator = psutil.Process(bed.emulator_pid)
        assert leftovers(bed.tag)  # the namespaces and cgroups exist meanwhile
    assert _gone(escaped)
    assert tracked.poll() is not None
    assert _gone(emulator)
    assert leftovers(bed.tag) == []


def test_an_error_inside_the_block_still_tears_down():
    made: list[str] = []

    def fail_inside() -> None:
        with Testbed(parse_topology(TWO)) as bed:
            made.append(bed.tag)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    assert leftovers(made[0]) == []


def test_a_host_gets_its_address_and_cpu_share():
    with Testbed(parse_topology(TWO)) as bed:
        quota = (bed.cgroup("x") / "cpu.cfs_quota_us").read_text().strip()
        period = (bed.cgroup("x") / "cpu.cfs_period_us").read_text().strip()
        assert (int(quota), int(period)) == (2_500, 10_000)  # 0.25 of a 10 ms period
        assert (bed.cgroup("y") / "cpu.cfs_quota_us").read_text().strip() == "-1"
        # The loop reads its own CPU: the process's startup (and the wrapper's, whose CPU an
        # exec keeps) runs partly outside the cgroup and, on a fresh clone, compiles .pyc files.
        spin = (
            "import time\nt=time.monotonic();c=time.process_time()\n"
            "while time.monotonic()-t<1.0: pass\nprint(time.process_time()-c)"
        )
        cpu = float(bed.run("x", [sys.executable, "-c", spin], timeout=30).stdout)
        assert cpu <= 0.25 * 1.0 * 1.3  # 1 s of wall time at a quarter core, at most
        shown = bed.run("x", ["ip", "-4", "-o", "addr", "show", "dev", "wan0"], timeout=10)
        assert f"inet {bed.address('x')}/24" in shown.stdout


def _in_cgroups_of(process: psutil.Process, tag: str) -> bool:
    try:
        return f"/{tag}/" in Path(f"/proc/{process.pid}/cgroup").read_text()
    except OSError:
        return False


def _ignoring_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_cli() -> subprocess.Popen:
    """``fusionllm-testbed up mini -- sleep 300`` as a script's background job starts it:
    with SIGINT inherited ignored (Python then raises no KeyboardInterrupt for it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "fusionllm.testbed", "up", "mini", "--", "sleep", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_ignoring_sigint,
    )  # fmt: skip


def _ended(cli: subprocess.Popen, timeout: float) -> int:
    """The CLI's exit code; if it has not exited in ``timeout``, its stacks in the failure."""
    try:
        return cli.wait(timeout)
    except subprocess.TimeoutExpired:
        cli.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack on stderr
        time.sleep(0.5)
        cli.kill()
        pytest.fail(f"no exit {timeout} s after SIGINT; its stderr: {cli.communicate()[1]}")


def test_ctrl_c_on_the_cli_tears_down():
    cli = _start_cli()
    try:
        line = cli.stdout.readline()  # "testbed TAG up: ..." once the hosts run the command
        assert line.startswith("testbed "), (line, cli.stderr.read() if cli.poll() else "")
        tag = line.split()[1]
        assert leftovers(tag)
        in_hosts = lambda: [p for p in psutil.process_iter() if _in_cgroups_of(p, tag)]  # noqa: E731
        # The hosts' commands start side by side: the first may be up before the third.
        wait_for(lambda: len(in_hosts()) >= 3, 10, "the command to start in every host")
        sleepers = in_hosts()
        assert len(sleepers) == 3  # one in each host
        cli.send_signal(signal.SIGINT)
        assert _ended(cli, 30) == 0, cli.stderr.read()
    finally:
        if cli.poll() is None:
            os.kill(cli.pid, signal.SIGKILL)
            cli.wait()
    assert leftovers(tag) == []
    assert all(_gone(p) for p in sleepers)


def _running_ip(cli: subprocess.Popen) -> bool:
    """The CLI is inside the setup: an ``ip`` of it runs."""
    try:
        return any(p.name() == "ip" for p in psutil.Process(cli.pid).children())
    except psutil.NoSuchProcess:
        return False


def test_ctrl_c_while_the_cli_sets_up_tears_down_once_it_is_up():
    cli = _start_cli()
    try:
        wait_for(lambda: _running_ip(cli), 10, "the CLI to set hosts up", poll=0.01)
        cli.send_signal(signal.SIGINT)
        assert _ended(cli, 30) == 0, cli.stderr.read()
        out = cli.stdout.read()
    finally:
        if cli.poll() is None:
            os.kill(cli.pid, signal.SIGKILL)
            cli.wait()
    assert "interrupted while coming up: tearing down" in out, out
    tag = out.split()[1]
    assert tag.startswith("fltb-"), out
    assert leftovers(tag) == []


_SCRIPT = """
import sys, time
from fusionllm.testbed.bed import Testbed
from fusionllm.testbed.topology import parse_topology
with Testbed(parse_topology({"name": "two", "hosts": [{"name": "x"}, {"name": "y"}]})) as bed:
    bed.popen("x", ["sleep", "300"])
    print(bed.tag, flush=True)
    time.sleep(300)
"""


def test_sigterm_on_a_script_inside_a_testbed_tears_down():
    """A benchmark stopped with `kill` (SIGTERM) leaves nothing behind: by default the signal
    ended the process at once, its namespaces, cgroups and node processes left over."""
    script = subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        tag = script.stdout.readline().strip()
        assert tag.startswith("fltb-"), (tag, script.stderr.read() if script.poll() else "")
        assert leftovers(tag)
        script.send_signal(signal.SIGTERM)
        assert script.wait(30) == 128 + signal.SIGTERM, script.stderr.read()
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
    assert leftovers(tag) == []
