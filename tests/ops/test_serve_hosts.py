"""`psclient serve` as docs/cluster.md runs it, on hosts of one network: closed by default.

Each host is a network namespace on one bridge (tests/_netns_hosts.py: made
here, removed afterwards, nothing changed in this process's namespace):
a ps host, a worker host, the coordinator's host ("chief"), a host that
joins later and a stranger. The tasks are started with the documented
command (`psclient serve --job ... --index ... --cluster cluster.json`,
nothing else), the coordinator trains from its own host, and the stranger
probes every port:
- the cluster's hosts get in (training runs across them, also after the
  worker is SIGKILLed and started again), the stranger reaches no port;
- `--allow-any-host` opens the port to the stranger, with a warning;
- a worker on a new host joins through `--peers-file` and trains;
- names, as on Kubernetes (`--peer-hosts`, each host's /etc/hosts standing
  in for the cluster's DNS): a name that does not resolve yet is admitted
  once it does, and followed when it moves to another address.
Every wait has a deadline; a probe tries each port once (1.5 s timeout).
"""

import json
import os
import sys

import pytest

import _netns_hosts
from _paths import ROOT_STR

PORT = 2222  # every task on its own host, at the port the docs use
# TensorFlow's import and start take seconds; on a loaded machine (load 10 on 2
# cores) over a minute: limits, not the time things take.
START = 240

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

_why_not = _netns_hosts.usable()
if _why_not:
    pytest.skip(_why_not, allow_module_level=True)

_COORDINATOR = """
import sys
import tensorflow as tf
import psclient
strategy = psclient.ParameterServerStrategy(psclient.Cluster.from_file(sys.argv[1]), connect_timeout=240)
with strategy.scope():
    v = tf.Variable(0.0)
@tf.function
def step():
    v.assign_add(1.0)
    return tf.distribute.coordinator.experimental_get_current_worker_index()
print("CONNECTED", flush=True)
for line in sys.stdin:
    command, *rest = line.split()
    if command == "train":
        futures = [strategy.schedule(step) for _ in range(int(rest[0]))]
        strategy.join()
        print("TRAINED", float(v.numpy()), sorted({int(f.result()) for f in futures}), flush=True)
    elif command == "move-to":  # the new worker alone from now on
        index = strategy.add_worker(rest[0])
        for worker in list(strategy.workers):
            if worker != index:
                strategy.remove_worker(worker)
        print("MOVED", index, flush=True)
    elif command == "quit":
        break
strategy.shutdown()
print("DONE", flush=True)
"""


@pytest.fixture(scope="module")
def network():
    net = _netns_hosts.Network()
    try:
        for tag, octet in (("ps", 1), ("worker", 2), ("chief", 3), ("joiner", 5), ("stranger", 9)):
            net.add(tag, octet)
        yield net
    finally:
        net.close()


@pytest.fixture
def children():
    env = dict(os.environ, PYTHONPATH=ROOT_STR)
    env.pop("TF_CONFIG", None)
    started = _netns_hosts.Children(env, ROOT_STR)
    yield started
    started.close()


def _serve(network, tag, job, cluster_file, *options):
    return network.command(tag, [sys.executable, "-m", "psclient", "serve", "--job", job, "--index", "0",
                                 "--cluster", str(cluster_file), *options])


def _send(process, line):
    process.stdin.write(line + "\n")
    process.stdin.flush()


@pytest.mark.long
def test_the_documented_command_admits_the_cluster_and_no_stranger(network, children, tmp_path):
    a = network.addresses
    cluster = {"worker": [f"{a['worker']}:{PORT}"], "ps": [f"{a['ps']}:{PORT}"], "chief": [f"{a['chief']}:{PORT}"]}
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(cluster))
    # Workers that join later are named in this file (docs/elastic.md); at first it is the cluster.
    peers_file = tmp_path / "peers.json"
    peers_file.write_text(json.dumps(cluster))
    _, ps = children.start(_serve(network, "ps", "ps", cluster_file, "--peers-file", str(peers_file)))
    worker_command = _serve(network, "worker", "worker", cluster_file)
    worker, worker_lines = children.start(worker_command)
    for lines in (ps, worker_lines):
        warning = lines.wait_for("drops every packet", timeout=START)
        assert f"from the cluster's own hosts ({a['ps']}, {a['worker']}, {a['chief']})" in warning
        lines.wait_for("ready at", timeout=START)
    coordinator, trained = children.start(
        network.command("chief", [sys.executable, "-c", _COORDINATOR, str(cluster_file)]), stdin=True)
    trained.wait_for("CONNECTED", timeout=START)
    _send(coordinator, "train 5")
    assert "TRAINED 5.0 [0]" in trained.wait_for("TRAINED", timeout=START)

    # The stranger reaches no port: neither the tasks' nor the coordinator's.
    tasks = [(a["ps"], PORT), (a["worker"], PORT), (a["chief"], PORT)]
    assert set(network.probe("stranger", tasks).values()) == {"TimeoutError"}
    # From a cluster host, each task port answers (the coordinator's: from the task hosts).
    assert set(network.probe("chief", tasks[:2]).values()) == {"connected"}
    assert network.probe("ps", [tasks[2]]) == {f"{a['chief']}:{PORT}": "connected"}

    # The worker is killed and started again with the same command: it rejoins, training goes on.
    worker.kill()
    worker.wait(timeout=60)
    _, worker_lines = children.start(worker_command)
    worker_lines.wait_for("ready at", timeout=START)
    _send(coordinator, "train 5")
    assert "TRAINED 10.0 [0]" in trained.wait_for("TRAINED", timeout=START)

    # A worker on a new host: the ps drops it until the peers file names it, then admits it.
    assert network.probe("joiner", [tasks[0]]) == {f"{a['ps']}:{PORT}": "TimeoutError"}
    joined = dict(cluster, worker=[*cluster["worker"], f"{a['joiner']}:{PORT}"])
    joined_file = tmp_path / "joined.json"
    joined_file.write_text(json.dumps(joined))
    peers_file.write_text(json.dumps(joined))
    assert a["joiner"] in ps.wait_for("admits", timeout=60)
    _, joiner = children.start(network.command("joiner", [
        sys.executable, "-m", "psclient", "serve", "--job", "worker", "--index", "1", "--cluster", str(joined_file)]))
    joiner.wait_for("ready at", timeout=START)
    _send(coordinator, f"move-to {a['joiner']}:{PORT}")
    assert "MOVED 1" in trained.wait_for("MOVED", timeout=START)
    _send(coordinator, "train 5")
    assert "TRAINED 15.0 [1]" in trained.wait_for("TRAINED", timeout=START)  # all on the new host's worker
    # Still nobody else.
    assert set(network.probe("stranger", [*tasks, (a["joiner"], PORT)]).values()) == {"TimeoutError"}
    _send(coordinator, "quit")
    trained.wait_for("DONE", timeout=120)


def test_allow_any_host_opens_the_port_and_says_so(network, children, tmp_path):
    a = network.addresses
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps({"worker": [f"{a['worker']}:{PORT + 1}"], "ps": [f"{a['ps']}:{PORT + 1}"]}))
    _, lines = children.start(_serve(network, "ps", "ps", cluster_file, "--allow-any-host"))
    warning = lines.wait_for("WARNING", timeout=START)
    assert "With --allow-any-host this task's port is open to EVERY host" in warning
    lines.wait_for("ready at", timeout=START)
    assert network.probe("stranger", [(a["ps"], PORT + 1)]) == {f"{a['ps']}:{PORT + 1}": "connected"}


def test_names_admitted_once_they_resolve_and_followed_when_they_move(network, children, tmp_path):
    """A ps pod as `psclient k8s` starts it: the cluster by DNS names, every task pod's name in
    --peer-hosts. The chief's pod is not scheduled yet; worker slot 1 is not scaled to."""
    a = network.addresses
    names = {"job-ps-0.job": a["ps"], "job-worker-0.job": a["worker"]}
    network.write_hosts("ps", names)
    cluster = {"chief": [f"job-chief-0.job:{PORT + 2}"], "ps": [f"job-ps-0.job:{PORT + 2}"],
               "worker": [f"job-worker-0.job:{PORT + 2}"]}
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(cluster))
    everyone = "job-chief-0.job,job-ps-0.job,job-worker-0.job,job-worker-1.job"
    _, lines = children.start(_serve(network, "ps", "ps", cluster_file, "--peer-hosts", everyone))
    warning = lines.wait_for("drops every packet", timeout=START)
    assert f"({a['ps']}, {a['worker']})" in warning
    said = "".join(lines.seen)
    assert "job-chief-0.job does not resolve yet" in said and "job-worker-1.job does not resolve yet" in said
    lines.wait_for("ready at", timeout=START)
    ps = (a["ps"], PORT + 2)
    target = f"{a['ps']}:{PORT + 2}"
    assert network.probe("worker", [ps]) == {target: "connected"}
    assert network.probe("stranger", [ps]) == {target: "TimeoutError"}
    # Worker slot 1 is scaled to: its pod gets the stranger's address. Admitted once it resolves.
    network.write_hosts("ps", dict(names, **{"job-worker-1.job": a["stranger"]}))
    assert a["stranger"] in lines.wait_for("admits", timeout=60)
    assert network.probe("stranger", [ps]) == {target: "connected"}
    # It is rescheduled on the joiner's host: followed there, and its old address dropped.
    network.write_hosts("ps", dict(names, **{"job-worker-1.job": a["joiner"]}))
    line = lines.wait_for("admits", timeout=60)
    assert a["joiner"] in line and a["stranger"] not in line
    assert network.probe("joiner", [ps]) == {target: "connected"}
    assert network.probe("stranger", [ps]) == {target: "TimeoutError"}
