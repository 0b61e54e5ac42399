"""The alerting rules shipped in examples/prometheus/psclient-alerts.yml, evaluated by Prometheus's own
`promtool test rules` (Debian's `prometheus` package, which `.ci/run` installs where missing) on
synthetic series of the metrics psclient serves: each alert fires on the situation it names and
stays quiet on a healthy job."""

import shutil
import subprocess
import textwrap

import pytest

from _paths import ROOT

RULES = ROOT / "examples" / "prometheus" / "psclient-alerts.yml"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="no `promtool` (Debian's package `prometheus`; "
                                                       ".ci/run installs it where apt-get can)")

TESTS = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # job "stuck": 5 functions queued, none finishes; job "fine": they finish.
      - series: 'psclient_closures_finished_total{{job="stuck", task="worker:0"}}'
        values: '40x30'
      - series: 'psclient_closures_queued{{job="stuck"}}'
        values: '5x30'
      - series: 'psclient_closures_in_flight{{job="stuck", task="worker:0"}}'
        values: '1x30'
      - series: 'psclient_closures_finished_total{{job="fine", task="worker:0"}}'
        values: '0+20x30'
      - series: 'psclient_closures_queued{{job="fine"}}'
        values: '5x30'
      - series: 'psclient_closures_in_flight{{job="fine", task="worker:0"}}'
        values: '1x30'
    alert_rule_test:
      - eval_time: 4m
        alertname: PsclientTrainingStalled
        exp_alerts: []
      - eval_time: 20m
        alertname: PsclientTrainingStalled
        exp_alerts:
          - exp_labels: {{severity: critical, job: stuck}}
            exp_annotations:
              summary: "stuck: no training step finished for 15 minutes while work waits"
              description: "Functions are queued or in flight but none finished. Check psclient_worker_up, psclient_ps_up and psclient_cluster_view_change_seconds, and the coordinator's log."

  - interval: 1m
    input_series:
      # A view change begins at 5m and waits; another instance's ended at once.
      - series: 'psclient_cluster_view_change_seconds{{job="train", instance="chief:9090"}}'
        values: '0 0 0 0 0 0+60x10'
      - series: 'psclient_cluster_view_change_seconds{{job="train", instance="other:9090"}}'
        values: '0x15'
    alert_rule_test:
      - eval_time: 6m
        alertname: PsclientClusterViewChangeStuck
        exp_alerts: []
      - eval_time: 8m
        alertname: PsclientClusterViewChangeStuck
        exp_alerts:
          - exp_labels: {{severity: warning, job: train, instance: "chief:9090"}}
            exp_annotations:
              summary: "chief:9090: TF's view change has waited 3m 0s"
              description: "No step runs until it returns. The coordinator's log names the tasks it waits on (\\"has waited ... so far\\"): a task that accepts connections but does not answer holds it; resume, restart or kill that task."

  - interval: 1m
    input_series:
      # ps:1 lost at 2m for good; ps:0 lost for 2 minutes only (recovered).
      - series: 'psclient_ps_up{{job="train", task="ps:1"}}'
        values: '1 1 0x20'
      - series: 'psclient_ps_up{{job="train", task="ps:0"}}'
        values: '1 1 0 0 1x18'
      # 3 workers: two out from 1m.
      - series: 'psclient_worker_up{{job="train", task="worker:0"}}'
        values: '1x22'
      - series: 'psclient_worker_up{{job="train", task="worker:1"}}'
        values: '1 0x21'
      - series: 'psclient_worker_up{{job="train", task="worker:2"}}'
        values: '1 0x21'
    alert_rule_test:
      - eval_time: 5m
        alertname: PsclientPsLost
        exp_alerts: []
      - eval_time: 8m
        alertname: PsclientPsLost
        exp_alerts:
          - exp_labels: {{severity: critical, job: train, task: "ps:1"}}
            exp_annotations:
              summary: "train: ps task ps:1 lost for 5 minutes"
              description: "psclient recovers a ps as soon as a task answers at its address again (from the newest checkpoint); until then no step that reads its variables runs. Is its pod restarting?"
      - eval_time: 5m
        alertname: PsclientFewWorkersUp
        exp_alerts: []
      - eval_time: 12m
        alertname: PsclientFewWorkersUp
        exp_alerts:
          - exp_labels: {{severity: warning, job: train}}
            exp_annotations:
              summary: "train: 1 workers up, under half of them, for 10 minutes"

  - interval: 1m
    input_series:
      # "idle" evaluated once at time 0; "busy" evaluates every minute (Unix time = seconds here).
      - series: 'psclient_evaluation_timestamp_seconds{{job="idle"}}'
        values: '0x80'
      - series: 'psclient_evaluation_timestamp_seconds{{job="busy"}}'
        values: '0+60x80'
    alert_rule_test:
      - eval_time: 62m
        alertname: PsclientEvaluatorIdle
        exp_alerts: []
      - eval_time: 70m
        alertname: PsclientEvaluatorIdle
        exp_alerts:
          - exp_labels: {{severity: warning, job: idle}}
            exp_annotations:
              summary: "idle: no evaluation for over an hour"
              description: "Either no new checkpoint was written (see the training job) or the evaluator cannot read them (psclient_checkpoints_unreadable_total)."
"""


def test_the_shipped_rules_are_valid_prometheus_rules():
    done = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 5 rules found" in done.stdout


def test_each_alert_fires_on_its_situation_and_not_on_a_healthy_job(tmp_path):
    tests = tmp_path / "psclient-alerts-test.yml"
    tests.write_text(textwrap.dedent(TESTS.format(rules=RULES)))
    done = subprocess.run([PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
