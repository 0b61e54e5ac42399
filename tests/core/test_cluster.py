"""Pure tests of `Cluster`: constructors, validation messages, TF_CONFIG, conversions."""

import json
import subprocess
import sys

import pytest

from psclient._cluster.spec import Cluster, task_from_env
from psclient._core.errors import ClusterConfigError

JOBS = {"worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]}


def tf_config(cluster, task=None):
    config = {"cluster": cluster}
    if task is not None:
        config["task"] = task
    return {"TF_CONFIG": json.dumps(config)}


# Construction and accessors ----------------------------------------------------


def test_accessors():
    c = Cluster({**JOBS, "chief": ["c:1"], "evaluator": ["e:1"]})
    assert c.workers == ("w0:2222", "w1:2222")
    assert c.ps == ("p0:2222",)
    assert (c.num_workers, c.num_ps) == (2, 1)
    assert c.chief == "c:1"
    assert c.evaluator == "e:1"
    assert c.address("worker", 1) == "w1:2222"
    assert c.tasks() == [("worker", 0, "w0:2222"), ("worker", 1, "w1:2222"), ("ps", 0, "p0:2222")]


def test_optional_jobs_default_to_none():
    c = Cluster(JOBS)
    assert c.chief is None and c.evaluator is None


def test_jobs_is_a_fresh_copy():
    c = Cluster(JOBS)
    jobs = c.jobs
    jobs["worker"].append("x:1")
    jobs["extra"] = ["y:1"]
    assert c.jobs == JOBS


def test_input_is_copied():
    jobs = {"worker": ["w0:1"], "ps": ["p0:1"]}
    c = Cluster(jobs)
    jobs["worker"].append("w1:1")
    assert c.workers == ("w0:1",)


@pytest.mark.parametrize(
    "address", ["localhost:1", "127.0.0.1:65535", "[::1]:2222", "my-host.example.com:80", "pod_0:1"]
)
def test_valid_addresses(address):
    assert Cluster({"worker": [address], "ps": ["p:1"]}).workers == (address,)


def test_sparse_dict_job_with_dense_indices():
    c = Cluster({"worker": {1: "w1:1", 0: "w0:1"}, "ps": {"0": "p0:1"}})
    assert c.workers == ("w0:1", "w1:1")
    assert c.ps == ("p0:1",)


def test_equality_hash_and_repr():
    a = Cluster(JOBS)
    b = Cluster({"ps": ["p0:2222"], "worker": ("w0:2222", "w1:2222")})
    assert a == b and hash(a) == hash(b)
    assert a != Cluster({"worker": ["w0:2222"], "ps": ["p0:2222"]})
    assert len({a, b}) == 1
    assert repr(a) == "Cluster({'worker': ['w0:2222', 'w1:2222'], 'ps': ['p0:2222']})"
    assert eval(repr(a)) == a


def test_address_errors():
    c = Cluster(JOBS)
    with pytest.raises(ValueError, match=r"`job`. Received: job='chief'. Expected one of \['worker', 'ps'\]"):
        c.address("chief", 0)
    with pytest.raises(IndexError, match=r"Received: index=2. Expected an integer in 0..1"):
        c.address("worker", 2)
    with pytest.raises(IndexError, match="Received: index=-1"):
        c.address("worker", -1)


# Validation messages -----------------------------------------------------------


@pytest.mark.parametrize(
    "address, reason",
    [
        ("foo", "no ':port' part"),
        (":2222", "no host"),
        ("host:0", "port '0'"),
        ("host:65536", "port '65536'"),
        ("host:http", "port 'http'"),
        ("host:²", "port '²'"),
        ("1.2.3.999:1", "'1.2.3.999' is not a valid IPv4 address"),
        ("::1:2222", "brackets"),
        ("[::g]:1", "not a valid IPv6 address"),
        ("bad host:1", "not a valid hostname"),
        (2222, "its type is int, not str"),
    ],
)
def test_bad_address_names_task_and_quotes_value(address, reason):
    with pytest.raises(ClusterConfigError) as info:
        Cluster({"worker": ["ok:1", address], "ps": ["p:1"]})
    message = str(info.value)
    assert "task worker:1" in message
    assert f"Received: {address!r}" in message
    assert reason in message
    assert "Expected 'host:port' with a port in 1..65535" in message


@pytest.mark.parametrize("missing", ["worker", "ps"])
def test_missing_required_job(missing):
    jobs = {job: a for job, a in JOBS.items() if job != missing}
    with pytest.raises(ClusterConfigError, match=f"no '{missing}' job.*Expected at least one 'worker' and one 'ps'"):
        Cluster(jobs)


def test_empty_job():
    with pytest.raises(ClusterConfigError, match=r"Job 'ps' has no tasks. Received: ps=\[\]"):
        Cluster({"worker": ["w:1"], "ps": []})


def test_duplicate_address_names_both_tasks():
    with pytest.raises(ClusterConfigError, match=r"Duplicate address 'a:1' for tasks worker:1 and ps:0"):
        Cluster({"worker": ["w:1", "a:1"], "ps": ["a:1"]})


def test_job_given_as_a_string():
    with pytest.raises(ClusterConfigError, match=r"Invalid tasks for job 'worker'. Received: 'w:1'. Expected a list"):
        Cluster({"worker": "w:1", "ps": ["p:1"]})


def test_non_string_job_name():
    with pytest.raises(ClusterConfigError, match=r"Invalid job name. Received: 3"):
        Cluster({"worker": ["w:1"], "ps": ["p:1"], 3: ["x:1"]})


def test_sparse_dict_with_a_gap():
    with pytest.raises(ClusterConfigError, match=r"indices for job 'worker'. Received: \[0, 2\]. Expected the indices 0..1"):
        Cluster({"worker": {0: "w0:1", 2: "w2:1"}, "ps": ["p:1"]})


def test_chief_must_be_single():
    with pytest.raises(ClusterConfigError, match="Job 'chief' must have exactly one task"):
        Cluster({**JOBS, "chief": ["c0:1", "c1:1"]})


def test_not_a_mapping():
    with pytest.raises(ClusterConfigError, match=r"Invalid cluster. Received: \['w:1'\]"):
        Cluster(["w:1"])


# Other constructors ------------------------------------------------------------


def test_from_dict():
    assert Cluster.from_dict(JOBS) == Cluster(JOBS)


class FakeClusterSpec:
    """Duck-types tf.train.ClusterSpec, so these tests need not import TensorFlow."""

    def __init__(self, jobs):
        self._jobs = jobs

    def as_dict(self):
        return self._jobs


class FakeResolver:
    def __init__(self, jobs):
        self._jobs = jobs

    def cluster_spec(self):
        return FakeClusterSpec(self._jobs)


def test_from_cluster_spec_and_resolver():
    assert Cluster.from_cluster_spec(FakeClusterSpec(JOBS)) == Cluster(JOBS)
    assert Cluster.from_resolver(FakeResolver(JOBS)) == Cluster(JOBS)


@pytest.mark.parametrize(
    "value",
    [JOBS, Cluster(JOBS), FakeClusterSpec(JOBS), FakeResolver(JOBS)],
    ids=["dict", "cluster", "spec", "resolver"],
)
def test_coerce(value):
    assert Cluster.coerce(value) == Cluster(JOBS)


def test_coerce_takes_a_local_clusters_cluster():
    # What `ParameterServerStrategy(local)` receives for a LocalCluster `local`:
    # anything whose `.cluster` is a Cluster (no processes needed to check it).
    class HasCluster:
        cluster = Cluster(JOBS)

    assert Cluster.coerce(HasCluster()) is HasCluster.cluster


def test_coerce_returns_the_same_cluster():
    c = Cluster(JOBS)
    assert Cluster.coerce(c) is c


@pytest.mark.parametrize("value", ["w:1,p:1", 3, None, [("worker", "w:1")]])
def test_coerce_rejects_other_types(value):
    with pytest.raises(TypeError, match=f"argument `cluster`. Received: {type(value).__name__}"):
        Cluster.coerce(value)


# TF_CONFIG ---------------------------------------------------------------------


def test_from_env():
    c = Cluster.from_env(tf_config({**JOBS, "evaluator": ["e:1"]}))
    assert c == Cluster({**JOBS, "evaluator": ["e:1"]})


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": JOBS}))
    assert Cluster.from_env() == Cluster(JOBS)


@pytest.mark.parametrize("environ", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  "}])
def test_from_env_without_tf_config(environ):
    with pytest.raises(ClusterConfigError, match="TF_CONFIG is not set"):
        Cluster.from_env(environ)


def test_invalid_json_quotes_the_text_near_the_error():
    text = '{"cluster": {"worker": ["w:1"], "ps": ["p:1",]}}'
    with pytest.raises(ClusterConfigError) as info:
        Cluster.from_env({"TF_CONFIG": text})
    message = str(info.value)
    assert "TF_CONFIG is not valid JSON" in message
    assert "line 1 column 46" in message
    assert '"ps": ["p:1",]}}' in message


def test_invalid_json_in_a_long_value_quotes_only_the_bad_part():
    workers = [f"w{i}:1" for i in range(50)]
    text = json.dumps({"cluster": {"worker": workers, "ps": ["p:1"]}}).replace('"w25:1",', '"w25:1" oops,')
    with pytest.raises(ClusterConfigError) as info:
        Cluster.from_env({"TF_CONFIG": text})
    message = str(info.value)
    assert '"w25:1" oops' in message
    assert '"w0:1"' not in message and '"w49:1"' not in message


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[1, 2]", r"TF_CONFIG must be a JSON object. Received: \[1, 2\]"),
        ('{"task": {"type": "worker"}}', r"TF_CONFIG has no 'cluster' key. Received keys: \['task'\]"),
        ('{"cluster": ["w:1"]}', r"Invalid TF_CONFIG\['cluster'\]. Received: \['w:1'\]"),
        (
            '{"cluster": {"worker": ["w:1"], "ps": ["nope"]}}',
            r"Invalid TF_CONFIG\['cluster'\]: Invalid address for task ps:0. Received: 'nope'",
        ),
    ],
)
def test_malformed_tf_config_quotes_the_bad_part(text, expected):
    with pytest.raises(ClusterConfigError, match=expected):
        Cluster.from_env({"TF_CONFIG": text})


def test_task_from_env():
    assert task_from_env({}) is None
    assert task_from_env(tf_config(JOBS)) is None
    assert task_from_env(tf_config(JOBS, {"type": "ps", "index": 0})) == ("ps", 0)
    assert task_from_env(tf_config(JOBS, {"type": "worker"})) == ("worker", 0)


@pytest.mark.parametrize("task", [{"index": 1}, {"type": "worker", "index": "1"}, ["worker", 1]])
def test_task_from_env_rejects_a_bad_task(task):
    with pytest.raises(ClusterConfigError, match=r"Invalid TF_CONFIG\['task'\]. Received: "):
        task_from_env(tf_config(JOBS, task))


# Conversions -------------------------------------------------------------------


def test_training_spec_drops_the_evaluator_and_keeps_the_chief():
    c = Cluster({**JOBS, "chief": ["c:1"], "evaluator": ["e:1"]})
    assert c.training_spec() == {**JOBS, "chief": ["c:1"]}
    assert "evaluator" in c.jobs


def test_to_tf_config():
    c = Cluster({**JOBS, "evaluator": ["e:1"]})
    config = json.loads(c.to_tf_config("evaluator", 0))
    assert config == {"cluster": c.jobs, "task": {"type": "evaluator", "index": 0}}
    assert "evaluator" not in json.loads(Cluster(JOBS).to_tf_config("ps", 0))["cluster"]
    assert Cluster.from_env({"TF_CONFIG": c.to_tf_config("worker", 1)}) == c
    with pytest.raises(IndexError, match="index=5"):
        c.to_tf_config("worker", 5)


def test_module_does_not_import_tensorflow():
    code = "import sys, psclient._cluster.spec; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.timeout(120)
def test_to_cluster_spec_drops_the_evaluator():
    tf = pytest.importorskip("tensorflow")
    c = Cluster({**JOBS, "chief": ["c:1"], "evaluator": ["e:1"]})
    spec = c.to_cluster_spec()
    assert isinstance(spec, tf.train.ClusterSpec)
    assert spec.as_dict() == c.training_spec()
    assert Cluster.from_cluster_spec(spec) == Cluster({**JOBS, "chief": ["c:1"]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec)
    assert Cluster.coerce(resolver) == Cluster.from_cluster_spec(spec)


def test_sparse_dict_with_a_repeated_index():
    with pytest.raises(ClusterConfigError, match=r"Duplicate task index 0 in job 'worker'"):
        Cluster({"worker": {0: "w0:1", "0": "w1:1"}, "ps": ["p:1"]})


# What every child process shares (psclient._cluster.process) --------------------


def test_child_env_runs_this_psclient_without_the_parents_task(monkeypatch):
    import os

    import psclient
    from psclient._cluster.process import child_env

    monkeypatch.setenv("TF_CONFIG", '{"task": {"type": "chief", "index": 0}}')
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    monkeypatch.setenv("GRPC_FAIL_FAST", "true")  # a coordinator's own setting is not inherited
    env = child_env()
    # The directory that holds the psclient package, before the inherited path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(psclient.__file__)))
    assert env["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"]
    assert "TF_CONFIG" not in env and "TF_CPP_MIN_LOG_LEVEL" not in env
    assert (env["PYTHONUNBUFFERED"], env["GRPC_FAIL_FAST"]) == ("1", "use_caller")
    env = child_env({"GRPC_FAIL_FAST": "false", "TF_CPP_MIN_LOG_LEVEL": "0"}, tf_config="{}", quiet_tf=True)
    assert (env["TF_CONFIG"], env["GRPC_FAIL_FAST"], env["TF_CPP_MIN_LOG_LEVEL"]) == ("{}", "false", "0")
    assert child_env(quiet_tf=True)["TF_CPP_MIN_LOG_LEVEL"] == "1"


@pytest.mark.parametrize("line, banner", [
    ("I0000 00:00:1795441036.668329   14230 port.cc:153] oneDNN custom operations are on.", True),
    ("I0000 00:00:1795441068.286302   15209 grpc_server_lib.cc:467] Started server with target: grpc://x", True),
    ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR", True),
    ("To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the "
     "appropriate compiler flags.", True),
    ("W0000 00:00:1795441069.849386   15216 context_distributed_manager.cc:968] Device filters ...", False),
    ("E0000 00:00:1795441069.859806   15310 context.cc:566] Unable to close remote context", False),
    ("psclient serve: worker:0 ready at 127.0.0.1:1 (pid 1)", False),
    ("Info: I0000 in the middle is not TensorFlow's", False),
])
def test_only_tensorflows_info_banners_count_as_noise(line, banner):
    from psclient._cluster.process import is_tf_banner

    assert is_tf_banner(line) is banner
