"""Pure tests of when a long-lived task server restarts itself, and of what it reads (no TensorFlow)."""

import argparse
import socket
import sys

import pytest

from psclient import _cli
from psclient._cluster import serve_command
from psclient._cluster import exposure
from psclient._core.recycling import IdleRecycler, TaskLoad

BASE = TaskLoad(connections=0, context_threads=3)


def load(connections=0, threads=3):
    return TaskLoad(connections=connections, context_threads=threads)


def test_a_fresh_task_never_restarts_however_long_it_is_idle():
    recycler = IdleRecycler(5.0, BASE, now=0.0)
    assert not any(recycler.observe(load(), now=t) for t in range(0, 10_000, 7))


def test_a_task_with_leftovers_restarts_after_idle_after_seconds_without_connections():
    recycler = IdleRecycler(5.0, BASE, now=0.0)
    assert not recycler.observe(load(connections=3, threads=7), now=1.0)  # a coordinator at work
    assert not recycler.observe(load(threads=7), now=2.0)  # it left: the clock starts
    assert recycler.idle_for(4.0) == 2.0
    assert not recycler.observe(load(threads=7), now=6.9)
    assert recycler.observe(load(threads=7), now=7.0)
    assert recycler.leftover_threads(load(threads=7)) == 4


def test_a_connection_while_idle_starts_the_clock_again():
    recycler = IdleRecycler(5.0, BASE, now=0.0)
    recycler.observe(load(threads=7), now=1.0)
    assert not recycler.observe(load(connections=1, threads=7), now=5.0)  # the next coordinator came
    assert recycler.idle_for(5.5) == 0.0
    assert not recycler.observe(load(threads=11), now=6.0)
    assert not recycler.observe(load(threads=11), now=10.9)
    assert recycler.observe(load(threads=11), now=11.0)


def test_a_paused_coordinator_keeps_its_connection_and_its_task():
    # A stopped (SIGSTOP) or idle coordinator still holds its TCP connections.
    recycler = IdleRecycler(1.0, BASE, now=0.0)
    assert not any(recycler.observe(load(connections=2, threads=7), now=t) for t in range(1, 3600))


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), None, "5"])
def test_idle_after_must_be_positive(bad):
    with pytest.raises((ValueError, TypeError), match="idle_after"):
        IdleRecycler(bad, BASE, now=0.0)


def _args(**overrides):
    values = dict(cluster=None, inter_op_threads=None, allow_any_host=False, restrict_to_peers=False,
                  peers_file=None, peer_hosts=None, parent_fd=None, recycle_when_idle=30.0, metrics_port=None)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_the_restart_command_serves_the_same_task_without_the_ready_fd(tmp_path):
    argv = serve_command.serve_again_argv(
        _args(cluster="c.json", inter_op_threads=4, peers_file="p.json", peer_hosts="a.j,b.j", parent_fd=9),
        "ps", 1)
    assert argv[:4] == [sys.executable, "-m", "psclient", "serve"]
    assert argv[4:8] == ["--job", "ps", "--index", "1"]
    assert "--ready-fd" not in argv
    options = dict(zip(argv[8::1], argv[9::1]))
    assert options["--cluster"].endswith("/c.json") and options["--cluster"].startswith("/")
    assert options["--peers-file"].startswith("/")
    assert options["--inter-op-threads"] == "4" and options["--parent-fd"] == "9"
    assert options["--recycle-when-idle"] == "30.0" and options["--peer-hosts"] == "a.j,b.j"
    assert "--allow-any-host" not in argv  # closed, as the first start was
    assert "--allow-any-host" in serve_command.serve_again_argv(_args(allow_any_host=True), "ps", 1)
    # A task serving metrics serves them again on the same port after its restart in place.
    again = serve_command.serve_again_argv(_args(metrics_port=9100), "ps", 1)
    assert again[again.index("--metrics-port") + 1] == "9100"
    # The minimal form: TF_CONFIG (kept in the environment) names the cluster.
    assert serve_command.serve_again_argv(_args(), "worker", 0)[4:] == [
        "--job", "worker", "--index", "0", "--recycle-when-idle", "30.0"]


def test_the_cli_rejects_a_non_positive_idle_time(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cli.main(["serve", "--job", "ps", "--index", "0", "--recycle-when-idle", "0"])
    assert exit_info.value.code == 2
    assert "--recycle-when-idle. Received: 0.0" in capsys.readouterr().err


@pytest.mark.skipif(not exposure.supported(), reason="reads /proc/net/tcp (Linux only)")
def test_connections_to_counts_open_connections_to_a_port_on_loopback():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert exposure.connections_to(port) == 0  # listening is not a connection
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        accepted = [server.accept()[0] for _ in clients]
        assert exposure.connections_to(port) == 2  # each counted once, at our end
        for sock in clients + accepted:
            sock.close()
        assert exposure.connections_to(port) == 0
