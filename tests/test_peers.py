"""`psclient serve --peers-file`: the peers a restricted task admits follow a cluster file (no TensorFlow)."""

import ipaddress
import json
import socket
import sys

import pytest

from psclient._cluster import exposure
from psclient._cluster.peers import PeerFile

LOCAL = ipaddress.ip_address("127.0.0.1")


def write(path, workers, ps=("127.0.0.1:2",)):
    path.write_text(json.dumps({"cluster": {"worker": list(workers), "ps": list(ps), "chief": ["127.0.0.1:3"]}}))


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, port, peers, *, what, lock, established_ok):
        self.calls.append((port, set(peers), what, lock, set(established_ok)))
        return 1


def make(tmp_path, lines):
    restrict = Recorder()
    path = tmp_path / "cluster.json"
    peer_file = PeerFile(path, {LOCAL}, 4444, what="ps:0", say=lines.append, restrict=restrict)
    return path, peer_file, restrict


def test_a_host_that_joins_the_file_is_admitted_and_one_that_leaves_is_dropped(tmp_path):
    lines = []
    path, peer_file, restrict = make(tmp_path, lines)
    write(path, ["127.0.0.1:5"])
    assert peer_file.wanted() == {LOCAL}
    assert peer_file.check() is False and restrict.calls == []  # nothing new
    assert peer_file.check() is False  # the file did not change: not read again
    write(path, ["127.0.0.1:5", "127.0.0.7:5"])
    assert peer_file.check() is True
    joined = ipaddress.ip_address("127.0.0.7")
    assert restrict.calls == [(4444, {LOCAL, joined}, "ps:0", False, {LOCAL})]
    assert peer_file.peers == {LOCAL, joined}
    assert "ps:0 admits 127.0.0.1, 127.0.0.7" in lines[-1]
    write(path, ["127.0.0.1:5"])  # it left: new connections from it are dropped again
    assert peer_file.check() is True
    # The connections it made while admitted are no intrusion.
    assert restrict.calls[-1] == (4444, {LOCAL}, "ps:0", False, {LOCAL, joined})


@pytest.mark.parametrize("content, message", [
    (None, "Cannot read cluster file"),
    ("{", "is not valid JSON"),
    (json.dumps({"worker": ["no-such-host.invalid:1"], "ps": ["127.0.0.1:2"]}), "cannot resolve"),
])
def test_a_bad_file_is_said_once_and_the_peers_stay(tmp_path, content, message):
    lines = []
    path, peer_file, restrict = make(tmp_path, lines)
    if content is not None:
        path.write_text(content)
    assert peer_file.check() is False and peer_file.check() is False
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "the peers in force stay" in errors[0]
    assert restrict.calls == [] and peer_file.peers == {LOCAL}
    write(path, ["127.0.0.9:1"])
    assert peer_file.check() is True  # fixed: applied


@pytest.mark.skipif(not exposure.supported(), reason="socket filters need Linux")
def test_an_unlocked_filter_is_replaced_on_a_real_listening_socket(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        path = tmp_path / "cluster.json"
        write(path, ["127.0.0.1:5"])
        lines = []
        peer_file = PeerFile(path, {LOCAL}, port, what="ps:0", say=lines.append)
        peer_file.apply(peer_file.wanted())
        write(path, ["127.0.0.1:5", "10.1.2.3:5"])
        assert peer_file.check() is True  # the kernel took the replacement
        assert ipaddress.ip_address("10.1.2.3") in peer_file.peers
        # Loopback still gets in.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass


def test_serve_refuses_peers_file_without_restrict_to_peers(tmp_path):
    import subprocess

    path = tmp_path / "cluster.json"
    write(path, ["127.0.0.1:5"])
    result = subprocess.run([sys.executable, "-m", "psclient", "serve", "--cluster", str(path), "--job", "worker",
                             "--index", "0", "--peers-file", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--peers-file" in result.stderr and "together with --restrict-to-peers" in result.stderr
