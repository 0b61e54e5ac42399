"""`psclient k8s`: the manifests of one job, checked offline (no cluster, no TensorFlow).

- Schema: every document validates (strict: no unknown fields) against the
  Kubernetes OpenAPI schemas shipped by `kubernetes-validate`, for 1.28 (the
  oldest release with the `apps.kubernetes.io/pod-index` label the pods read)
  and for the newest release the installed package has.
- Content: each pod gets the environment Kubernetes would give it (downward
  API values, then `$(VAR)` substitution in env values and the command, as the
  kubelet does); its TF_CONFIG must be accepted by `Cluster.from_env()`, name
  the same cluster as every other pod, and name the pod itself at its stable
  DNS name under the headless Service. The NetworkPolicy must select every
  pod and admit the task pods to every port in TF_CONFIG.
- Bad arguments fail with exit status 2 and a message naming the option.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest

from psclient import Cluster
from psclient._cli import build_parser
from psclient._cluster.peers import cluster_hosts
from psclient._cluster.serve_command import peer_hosts_option
from psclient._cluster.serve_command import resolve_task as _resolve_task
from psclient._cluster.k8s import (
    CHECKPOINT_ENV,
    POD_INDEX_LABEL,
    K8sJob,
    manifests,
    to_yaml,
)
from psclient._cluster.spec import cluster_from_config, read_tf_config, task_from_config

from _paths import ROOT_STR

yaml = pytest.importorskip("yaml", reason="PyYAML (the k8s/test extra) is not installed")

OLDEST_SUPPORTED = "1.28"

pytestmark = pytest.mark.timeout(120)


def psclient(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT_STR)
    env.pop("TF_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "psclient", *args], capture_output=True, text=True, check=False,
                          timeout=60, cwd=ROOT_STR, env=env)


JOBS = {
    "plain": K8sJob(name="mnist", image="registry.example.com/train:1", command=["python", "train.py"],
                    workers=3, ps=2),
    "evaluator": K8sJob(name="big-run-7", image="train:2", command=["python", "-m", "train",
                        "--checkpoint-dir", f"$({CHECKPOINT_ENV})/model"], workers=1, ps=1,
                        evaluator=True, evaluator_model="train:model", evaluator_data="train:data",
                        evaluator_checkpoint_dir="/checkpoints/model", port=5000, storage_class="nfs",
                        worker_cpu="500m", worker_memory="1.5Gi"),
    # Prometheus metrics on every pod, scrape annotations.
    "metrics": K8sJob(name="scraped", image="i", command=["train"], workers=2, ps=1, evaluator=True,
                      evaluator_model="m:f", evaluator_data="m:g", metrics_port=9100),
    # The longest name: every derived name (pods, hostnames, revision labels) still fits.
    "longest-name": K8sJob(name="j" + "-" * 43 + "9", image="i", command=["train"], workers=2, ps=1,
                           evaluator=True, evaluator_model="m:f", evaluator_data="m:g", chief_restarts=0),
}


@pytest.fixture(params=sorted(JOBS))
def job(request) -> K8sJob:
    return JOBS[request.param]


# The environment and command a pod gets ---------------------------------------


def _pods(docs):
    """(pod name, hostname, subdomain, labels, pod spec) of every pod the documents make."""
    for doc in docs:
        template = doc.get("spec", {}).get("template")
        if doc["kind"] == "StatefulSet":
            for i in range(doc["spec"]["replicas"]):
                # The StatefulSet controller names pod i NAME-i, sets its hostname to
                # that and its subdomain to serviceName, and labels it with its index.
                name = f"{doc['metadata']['name']}-{i}"
                labels = dict(template["metadata"]["labels"], **{POD_INDEX_LABEL: str(i)})
                yield name, name, doc["spec"]["serviceName"], labels, template["spec"]
        elif doc["kind"] == "Job":
            spec = template["spec"]
            yield doc["metadata"]["name"], spec["hostname"], spec["subdomain"], \
                template["metadata"]["labels"], spec


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` substitution: defined names are replaced, `$$` is one `$`,
    anything else stays as written."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _environment(container: dict, labels: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)  # only earlier variables are seen
            continue
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
        assert label, f"unexpected downward API field {path}"
        env[var["name"]] = labels.get(label.group(1), "")
    return env


def _volume_claims(pod_spec: dict) -> dict[str, str]:
    """mountPath -> PersistentVolumeClaim name of the pod's only container."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in pod_spec.get("volumes", []) if "persistentVolumeClaim" in v}
    return {m["mountPath"]: claims[m["name"]] for m in pod_spec["containers"][0].get("volumeMounts", [])}


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        ok = ok and labels.get(expression["key"]) in expression["values"]
    return ok


# Schema ---------------------------------------------------------------------


def _schema_versions() -> list[str]:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (test extra) is not installed")
    return [OLDEST_SUPPORTED, kubernetes_validate.latest_version()]


def test_every_document_validates_against_the_kubernetes_schemas(job):
    import kubernetes_validate

    docs = manifests(job)
    assert [d["kind"] for d in docs][:3] == ["NetworkPolicy", "Service", "PersistentVolumeClaim"]
    for version in _schema_versions():
        for doc in docs:
            try:
                used = kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['kind']} {doc['metadata']['name']} is invalid for Kubernetes "
                            f"{version}: {e.message} at {list(e.path)}")
            assert used == ".".join(version.split(".")[:2])  # the schemas of that release were used


def test_schema_validation_catches_a_broken_manifest():
    """The validator is not a no-op: misspelt fields (top level, nested) and a wrong type are rejected."""
    import kubernetes_validate

    docs = manifests(JOBS["plain"])
    stateful_set = next(d for d in docs if d["kind"] == "StatefulSet")
    stateful_set["spec"]["replica"] = stateful_set["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(stateful_set, OLDEST_SUPPORTED, strict=True)
    chief = next(d for d in docs if d["kind"] == "Job")
    chief["spec"]["template"]["spec"]["containers"][0]["commands"] = ["python"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(chief, OLDEST_SUPPORTED, strict=True)
    policy = docs[0]
    policy["spec"]["ingress"][0]["ports"][0]["port"] = [2222]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, OLDEST_SUPPORTED, strict=True)


# Content --------------------------------------------------------------------


def test_every_pod_gets_a_tf_config_naming_the_same_tasks_at_their_stable_names(job):
    docs = manifests(job)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    pods = list(_pods(docs))
    expected_roles = {"chief": 1, "worker": job.workers, "ps": job.ps, "evaluator": int(job.evaluator)}
    assert len(pods) == sum(expected_roles.values())
    clusters, seen = set(), []
    for pod_name, hostname, subdomain, labels, spec in pods:
        env = _environment(spec["containers"][0], labels)
        cluster = Cluster.from_env(env)  # what the pod's process reads
        clusters.add(cluster)
        role, index = task_from_config(read_tf_config(env), source="TF_CONFIG")
        seen.append((role, index))
        assert labels["app.kubernetes.io/component"] == role, pod_name
        # The task's address is the pod's own DNS name under a headless Service
        # that selects the pod and publishes it before it is ready.
        service = services[subdomain]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
        assert _selects({"matchLabels": service["spec"]["selector"]}, labels), pod_name
        host, _, port = cluster.address(role, index).rpartition(":")
        assert host == f"{hostname}.{subdomain}", pod_name
        ports = {p["containerPort"] for p in spec["containers"][0].get("ports", [])}
        if role in ("chief", "ps", "worker"):
            assert int(port) in ports, f"{pod_name} does not declare its task port {port}"
        if role in ("ps", "worker"):
            # `psclient serve`, closed to all but the job's task pods, picks this pod's task from TF_CONFIG.
            args = _serve_args(spec["containers"][0]["command"])
            assert (args.job, args.index, args.cluster, args.allow_any_host) == (None, None, None, False)
            served = _resolve_task(argparse.Namespace(job=None, index=None),
                                   cluster_from_config(read_tf_config(env), source="TF_CONFIG"),
                                   (role, index))
            assert served == (role, index)
    assert len(clusters) == 1, "pods disagree on the cluster"
    (cluster,) = clusters
    assert sorted(seen) == sorted((r, i) for r, n in expected_roles.items() for i in range(n))
    assert cluster == job.cluster()
    assert {r: len(a) for r, a in cluster.jobs.items()} == {r: n for r, n in expected_roles.items() if n}


def _serve_args(command):
    """The `psclient serve` command line of a task pod, parsed as the real command parses it."""
    assert command[:2] == ["psclient", "serve"], command
    return build_parser().parse_args(command[1:])


@pytest.mark.parametrize("which", ["plain", "evaluator", "elastic"])
def test_the_socket_filter_admits_the_pods_the_network_policy_admits(which):
    """Each task pod's `psclient serve` admits (besides loopback) the DNS names of the
    job's chief, ps and worker pods, scaled-up worker slots included: the pods the
    NetworkPolicy admits, so a network plugin that ignores the policy changes nothing."""
    job = ELASTIC if which == "elastic" else JOBS[which]
    docs = manifests(job)
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    (peer,) = policy["spec"]["ingress"][0]["from"]
    pods = list(_pods(docs))
    if job.elastic:  # the pods a `kubectl scale` to --max-workers adds
        template = next(p for p in pods if p[0] == f"{job.name}-worker-0")
        pods += [(f"{job.name}-worker-{i}", f"{job.name}-worker-{i}", template[2],
                  dict(template[3], **{POD_INDEX_LABEL: str(i)}), template[4])
                 for i in range(job.workers, job.max_workers)]
    by_policy = {f"{hostname}.{subdomain}" for _, hostname, subdomain, labels, _ in pods
                 if _selects(peer["podSelector"], labels)}
    tasks = [(name, spec) for name, _, _, labels, spec in pods
             if labels["app.kubernetes.io/component"] in ("ps", "worker")]
    assert len(tasks) == job.ps + (job.max_workers or job.workers)
    for name, spec in tasks:
        args = _serve_args(spec["containers"][0]["command"])
        assert not args.allow_any_host, name
        assert set(peer_hosts_option(args.peer_hosts)) == by_policy, name
    assert not any("evaluator" in host for host in by_policy)
    # Every cluster host the pod's TF_CONFIG names (all jobs but the evaluator) may resolve
    # late: pods start in any order, and worker slots exist only once scaled to.
    name, spec = tasks[-1]
    env = _environment(spec["containers"][0], next(p[3] for p in pods if p[0] == name))
    assert set(cluster_hosts(Cluster.from_env(env))) <= by_policy


def test_the_network_policy_covers_every_task_port_and_selects_every_pod(job):
    docs = manifests(job)
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    pods = list(_pods(docs))
    for pod_name, _, _, labels, _ in pods:
        assert _selects(spec["podSelector"], labels), f"the policy does not protect {pod_name}"
    # The first rule is the task port's; with --metrics-port a second opens that port alone
    # (test_metrics_port_reaches_every_pod_with_scrape_annotations_and_an_open_port).
    rule, *metrics = spec["ingress"]
    assert len(metrics) == (job.metrics_port is not None)
    admitted_ports = {(p["protocol"], p["port"]) for p in rule["ports"]}
    env = _environment(pods[0][4]["containers"][0], pods[0][3])
    task_ports = {("TCP", int(a.rpartition(":")[2])) for addrs in Cluster.from_env(env).jobs.values()
                  for a in addrs}
    assert task_ports <= admitted_ports
    # Who gets in: the job's own chief, ps and worker pods; nothing else.
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector or ipBlock: this namespace only
    admitted = {labels["app.kubernetes.io/component"] for _, _, _, labels, _ in pods
                if _selects(peer["podSelector"], labels)}
    assert admitted == {"chief", "ps", "worker"}
    stranger = {"app.kubernetes.io/name": "psclient", "app.kubernetes.io/instance": "other-job",
                "app.kubernetes.io/component": "worker"}
    assert not _selects(peer["podSelector"], stranger)


def test_the_chief_restarts_and_resumes_from_the_checkpoint_volume(job):
    docs = manifests(job)
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    jobs = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in docs if d["kind"] == "Job"}
    chief = jobs["chief"]
    spec = chief["spec"]["template"]["spec"]
    assert spec["restartPolicy"] == "OnFailure" and chief["spec"]["backoffLimit"] == job.chief_restarts
    env = _environment(spec["containers"][0], {})
    mounts = _volume_claims(spec)
    assert mounts == {env[CHECKPOINT_ENV]: claim["metadata"]["name"]}
    # The command is the user's, with $(PSCLIENT_CHECKPOINT_DIR) on the volume.
    command = [_expand(a, env) for a in spec["containers"][0]["command"]]
    assert command == [_expand(a, env) for a in job.command]
    if "--checkpoint-dir" in command:
        assert command[command.index("--checkpoint-dir") + 1].startswith(env[CHECKPOINT_ENV] + "/")
    if job.evaluator:
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # two pods, maybe two nodes
        spec = jobs["evaluator"]["spec"]["template"]["spec"]
        command = spec["containers"][0]["command"]
        assert command[:2] == ["psclient", "evaluate"]
        directory = command[command.index("--checkpoint-dir") + 1]
        (mount_path, claim_name), = _volume_claims(spec).items()
        assert claim_name == claim["metadata"]["name"]
        assert directory == job.evaluator_checkpoint_dir and directory.startswith(mount_path)
        assert command[command.index("--model") + 1] == job.evaluator_model
    else:
        assert set(jobs) == {"chief"}


def test_every_object_is_labelled_with_the_job_and_every_pod_requests_resources(job):
    docs = manifests(job)
    for doc in docs:
        assert doc["metadata"]["name"].startswith(job.name)
        # Names are DNS labels (63 characters); a StatefulSet's pods are labelled
        # controller-revision-hash=<set name>-<hash of up to 10 characters>.
        assert len(doc["metadata"]["name"]) <= (52 if doc["kind"] == "StatefulSet" else 63)
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == job.name
    for pod_name, hostname, _, labels, spec in _pods(docs):
        assert len(pod_name) <= 63 and len(hostname) <= 63
        role = labels["app.kubernetes.io/component"]
        resources = spec["containers"][0]["resources"]
        assert resources["requests"] == {"cpu": getattr(job, f"{role}_cpu"),
                                         "memory": getattr(job, f"{role}_memory")}, pod_name
        assert resources["limits"]["memory"] == getattr(job, f"{role}_memory")
        assert spec["automountServiceAccountToken"] is False


# The command ----------------------------------------------------------------


def test_the_command_prints_the_same_documents_as_yaml():
    job = JOBS["evaluator"]
    result = psclient("k8s", "--name", job.name, "--image", job.image, "--workers", "1", "--ps", "1",
                      "--evaluator", "--evaluator-model", "train:model", "--evaluator-data", "train:data",
                      "--evaluator-checkpoint-dir", "/checkpoints/model", "--port", "5000",
                      "--storage-class", "nfs", "--worker-cpu", "500m", "--worker-memory", "1.5Gi",
                      "--", *job.command)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# psclient k8s: job big-run-7")
    assert list(yaml.safe_load_all(result.stdout)) == manifests(job)
    assert to_yaml(manifests(job)).count("\n---\n") == len(manifests(job)) - 1


def test_psclient_serve_accepts_a_worker_pods_environment():
    """The real `psclient serve`, no arguments, with the TF_CONFIG of pod mnist-worker-2:
    it takes its task from TF_CONFIG and gets as far as the address check (exit 1:
    the pod's DNS name does not resolve here), not an argument error (exit 2)."""
    docs = manifests(JOBS["plain"])
    pod = next(p for p in _pods(docs) if p[0] == "mnist-worker-2")
    env = dict(os.environ, PYTHONPATH=ROOT_STR, **_environment(pod[4]["containers"][0], pod[3]))
    command = pod[4]["containers"][0]["command"]  # the pod's own: psclient serve --peer-hosts ...
    result = subprocess.run([sys.executable, "-m", "psclient", *command[1:]], capture_output=True, text=True,
                            check=False, timeout=60, cwd=ROOT_STR, env=env)
    assert result.returncode == 1, result.stderr
    assert "cannot start worker:2 at mnist-worker-2.mnist:2222" in result.stderr


def test_a_worker_pod_scaled_beyond_the_cluster_is_refused():
    """`kubectl scale` past --workers makes pods whose index TF_CONFIG does not have:
    their `psclient serve` stops with an argument error naming the index (docs/kubernetes.md
    says so; adding workers at run time is docs/elastic.md)."""
    docs = manifests(JOBS["plain"])
    pod = next(p for p in _pods(docs) if p[0] == "mnist-worker-0")
    labels = dict(pod[3], **{POD_INDEX_LABEL: "3"})  # what a 4th replica would carry
    env = dict(os.environ, PYTHONPATH=ROOT_STR, **_environment(pod[4]["containers"][0], labels))
    result = subprocess.run([sys.executable, "-m", "psclient", "serve"], capture_output=True, text=True, check=False,
                            timeout=60, cwd=ROOT_STR, env=env)
    assert result.returncode == 2, result.stderr
    assert "Received: 3. Expected an integer in 0..2: the cluster has 3 worker task(s)" in result.stderr


def test_help_has_an_example_that_works():
    result = psclient("k8s", "--help")
    assert result.returncode == 0, result.stderr
    assert "--worker-memory" in result.stdout and "unauthenticated RPCs" in result.stdout
    example = result.stdout.split("example:\n", 1)[1].split("kubectl apply")[0]
    argv = shlex.split(example.replace("\\\n", " "))
    assert argv[:2] == ["psclient", "k8s"] and argv[-2] == ">"
    run = psclient(*argv[1:-2])  # as typed, less the redirection
    assert run.returncode == 0, run.stderr
    docs = list(yaml.safe_load_all(run.stdout))
    assert {d["kind"] for d in docs} >= {"StatefulSet", "Job", "NetworkPolicy", "Service"}


BASE = {"--name": "mnist", "--image": "train:1", "--workers": "2", "--ps": "1"}


def _argv(args: list[str]) -> list[str]:
    """`psclient k8s` with BASE's required options, unless `args` gives them itself."""
    argv = ["k8s"]
    for option, value in BASE.items():
        if option not in args:
            argv += [option, value]
    return argv + args


@pytest.mark.parametrize("args, message", [
    (["--name", "Mnist"], "Invalid value for --name. Received: 'Mnist'. Expected a DNS-1035 label"),
    (["--name", "1mnist"], "Invalid value for --name. Received: '1mnist'."),
    (["--name", "mnist_run"], "Invalid value for --name. Received: 'mnist_run'."),
    (["--name", "a" * 46], "of at most 45 characters"),
    (["--image", ""], "Invalid value for --image. Received: ''."),
    (["--workers", "0"], "Invalid value for --workers. Received: 0. Expected an integer >= 1."),
    (["--ps", "-1"], "Invalid value for --ps. Received: -1. Expected an integer >= 1."),
    (["--workers", "two"], "argument --workers: invalid int value: 'two'"),
    (["--port", "70000"], "Invalid value for --port. Received: 70000. Expected an integer in 1..65535."),
    (["--chief-restarts", "-1"], "Invalid value for --chief-restarts. Received: -1. Expected an integer >= 0."),
    (["--max-workers", "1"], "Invalid value for --max-workers. Received: 1. Expected at least --workers"),
    (["--recycle-when-idle", "0"], "Invalid value for --recycle-when-idle. Received: 0.0."),
    (["--worker-memory", "4GB"], ("Invalid value for --worker-memory. Received: '4GB'. Expected a positive "
                                  "Kubernetes quantity")),
    (["--ps-cpu", "0"], "Invalid value for --ps-cpu. Received: '0'."),
    (["--checkpoint-size", "lots"], "Invalid value for --checkpoint-size. Received: 'lots'."),
    (["--storage-class", "Fast SSD"], "Invalid value for --storage-class. Received: 'Fast SSD'."),
    (["--evaluator"], "Missing --evaluator-model: --evaluator needs both --evaluator-model and --evaluator-data"),
    (["--evaluator", "--evaluator-model", "train:model"], "Missing --evaluator-data"),
    (["--evaluator", "--evaluator-model", "train", "--evaluator-data", "train:data"],
     "Invalid value for --evaluator-model. Received: 'train'. Expected MODULE:FUNCTION"),
    (["--evaluator-model", "train:model"],
     "Invalid value for --evaluator-model. Received: 'train:model'. Expected it only together with --evaluator"),
    (["--evaluator", "--evaluator-model", "t:m", "--evaluator-data", "t:d", "--evaluator-checkpoint-dir", "/data"],
     ("Invalid value for --evaluator-checkpoint-dir. Received: '/data'. Expected a normalised path on the "
      "checkpoint volume: /checkpoints or under it.")),
])
def test_bad_arguments_name_the_option(args, message):
    result = psclient(*_argv(args), "--", "python", "train.py")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert result.stdout == "", "nothing may be printed for bad arguments"


def test_no_command_is_an_error():
    result = psclient(*_argv([]))
    assert result.returncode == 2
    assert "No training command given. Expected the chief's command after --" in result.stderr


def test_missing_required_options_are_named():
    result = psclient("k8s", "--name", "mnist", "--", "python", "train.py")
    assert result.returncode == 2
    assert "the following arguments are required: --image, --workers, --ps" in result.stderr


# --max-workers: a worker StatefulSet that may be scaled up ----------------------

ELASTIC = K8sJob(name="mnist", image="train:1", command=["python", "train.py"], workers=2, ps=1, max_workers=4)


def test_max_workers_manifests_validate_against_the_kubernetes_schemas():
    import kubernetes_validate

    docs = manifests(ELASTIC)
    assert {"ServiceAccount", "Role", "RoleBinding"} <= {d["kind"] for d in docs}
    for version in _schema_versions():
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['kind']} {doc['metadata']['name']} is invalid for Kubernetes "
                            f"{version}: {e.message} at {list(e.path)}")


def _scaled_pod_env(job: K8sJob, index: int) -> dict[str, str]:
    pod = next(p for p in _pods(manifests(job)) if p[0] == f"{job.name}-worker-0")
    return _environment(pod[4]["containers"][0], dict(pod[3], **{POD_INDEX_LABEL: str(index)}))


def test_a_worker_pod_scaled_up_to_max_workers_finds_itself_and_the_chief_starts_with_workers():
    pods = {p[0]: p for p in _pods(manifests(ELASTIC))}
    chief = Cluster.from_env(_environment(pods["mnist-chief"][4]["containers"][0], pods["mnist-chief"][3]))
    assert chief.num_workers == 2  # the strategy starts with --workers; a watcher adds the others
    for index in range(4):  # pods 2 and 3 exist once `kubectl scale ... --replicas=4`
        env = _scaled_pod_env(ELASTIC, index)
        cluster = Cluster.from_env(env)
        assert task_from_config(read_tf_config(env), source="TF_CONFIG") == ("worker", index)
        assert cluster.address("worker", index) == f"mnist-worker-{index}.mnist:2222"
        assert cluster.ps == chief.ps
    # The real `psclient serve` of the 4th pod gets as far as the address check (exit 1:
    # the DNS name does not resolve here); a 5th, past --max-workers, is an argument error.
    for index, status, message in ((3, 1, "cannot start worker:3 at mnist-worker-3.mnist:2222"),
                                   (4, 2, "Received: 4. Expected an integer in 0..3")):
        env = dict(os.environ, PYTHONPATH=ROOT_STR, **_scaled_pod_env(ELASTIC, index))
        result = subprocess.run([sys.executable, "-m", "psclient", "serve"], capture_output=True, text=True,
                                check=False, timeout=60, cwd=ROOT_STR, env=env)
        assert result.returncode == status, result.stderr
        assert message in result.stderr


def test_only_the_chief_gets_a_token_and_it_can_only_read_pods():
    docs = manifests(ELASTIC)
    with_token = [name for name, _h, _s, _l, spec in _pods(docs) if spec.get("automountServiceAccountToken")]
    assert with_token == ["mnist-chief"]
    chief = next(spec for name, _h, _s, _l, spec in _pods(docs) if name == "mnist-chief")
    role = next(d for d in docs if d["kind"] == "Role")
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": chief["serviceAccountName"]}]
    # Without --max-workers (or equal to --workers): no account, no token anywhere.
    for job in (JOBS["plain"], K8sJob(name="a", image="i", command=["t"], workers=2, ps=1, max_workers=2)):
        plain = manifests(job)
        assert not {"ServiceAccount", "Role", "RoleBinding"} & {d["kind"] for d in plain}
        assert not any(spec.get("automountServiceAccountToken") for *_rest, spec in _pods(plain))


def test_recycle_when_idle_reaches_every_task_and_the_manifests_stay_valid():
    import kubernetes_validate

    job = K8sJob(name="pool", image="train:1", command=["python", "train.py"], workers=2, ps=1,
                 recycle_when_idle=60)
    docs = manifests(job)
    commands = {doc["metadata"]["name"]: doc["spec"]["template"]["spec"]["containers"][0]["command"]
                for doc in docs if doc["kind"] == "StatefulSet"}
    peers = ",".join(["pool-chief-0.pool", "pool-ps-0.pool", "pool-worker-0.pool", "pool-worker-1.pool"])
    assert commands == {f"pool-{role}": ["psclient", "serve", "--peer-hosts", peers, "--recycle-when-idle", "60"]
                        for role in ("ps", "worker")}
    chief = next(doc for doc in docs if doc["kind"] == "Job")
    assert "--recycle-when-idle" not in chief["spec"]["template"]["spec"]["containers"][0]["command"]
    for doc in docs:
        kubernetes_validate.validate(doc, _schema_versions()[-1], strict=True)
    # Without the option the tasks' command is unchanged.
    plain = K8sJob(name="pool", image="train:1", command=["python", "train.py"], workers=2, ps=1)
    assert all(doc["spec"]["template"]["spec"]["containers"][0]["command"] == ["psclient", "serve", "--peer-hosts", peers]
               for doc in manifests(plain) if doc["kind"] == "StatefulSet")


def test_metrics_port_reaches_every_pod_with_scrape_annotations_and_an_open_port():
    docs = manifests(JOBS["metrics"])
    pods = list(_pods(docs))
    assert {labels["app.kubernetes.io/component"] for _, _, _, labels, _ in pods} == {
        "ps", "worker", "chief", "evaluator"}
    templates = [d["spec"]["template"] for d in docs if d["kind"] in ("StatefulSet", "Job")]
    for template in templates:
        assert template["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true", "prometheus.io/port": "9100", "prometheus.io/path": "/metrics"}
        container = template["spec"]["containers"][0]
        assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in container["ports"]
        role = template["metadata"]["labels"]["app.kubernetes.io/component"]
        command = container["command"]
        if role == "chief":  # the script reads it: StrategyConfig(metrics_port=...)
            assert {"name": "PSCLIENT_METRICS_PORT", "value": "9100"} in container["env"]
        else:  # psclient serve / psclient evaluate serve it themselves
            assert command[command.index("--metrics-port") + 1] == "9100"
            build_parser().parse_args(command[1:])  # a command line psclient accepts
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    rules = policy["spec"]["ingress"]
    task_rule, metrics_rule = rules
    assert metrics_rule == {"ports": [{"protocol": "TCP", "port": 9100}]}  # from anywhere: reads only
    assert task_rule["ports"] == [{"protocol": "TCP", "port": JOBS["metrics"].port}]
    # Without it: no annotations, no extra rule.
    plain = manifests(JOBS["plain"])
    assert all("annotations" not in d["spec"]["template"]["metadata"]
               for d in plain if d["kind"] in ("StatefulSet", "Job"))


@pytest.mark.parametrize("port", [0, 70000, "9100"])
def test_a_bad_k8s_metrics_port_is_refused(port):
    with pytest.raises(ValueError, match="metrics_port"):
        K8sJob(name="m", image="i", command=["t"], workers=1, ps=1, metrics_port=port)


def test_the_metrics_port_must_differ_from_the_task_port():
    with pytest.raises(ValueError, match="another port than --port"):
        K8sJob(name="m", image="i", command=["t"], workers=1, ps=1, port=9100, metrics_port=9100)
