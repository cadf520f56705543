"""trainer/kubeflow_status.py against a real HTTPS server on loopback (its certificate from
openssl): what is sent, with which credential, how often, and what a refusal does. Kubeflow
Trainer's own status server takes these POSTs on the Kubernetes testbed
(tests/test_k8s_e2e.py `assert_trainer_status`)."""

from __future__ import annotations

import http.server
import json
import ssl
import subprocess
import threading

import pytest

from trainer import kubeflow_status
from trainer.kubeflow_status import StatusReporter, trainer_status


def record(step: int, state: str = "running", **fields) -> dict:
    return {"state": state, "step": step, "total_steps": 40, "eta_s": 12.6, "loss": 0.25, "epoch": 1,
            "samples_per_s": 1234.5678, "steps_per_s": 3.0, "restarts": 0, "updated": 1796600000.0,
            "run": {"goodput": 0.8125}, **fields}


def test_a_record_becomes_trainer_status_with_string_metrics():
    status = trainer_status(record(10))
    assert status["progressPercentage"] == 25 and status["estimatedRemainingSeconds"] == 13
    assert status["lastUpdatedTime"] == "2026-12-06T23:33:20Z"  # RFC 3339, UTC, as metav1.Time
    assert {m["name"]: m["value"] for m in status["metrics"]} == {
        "step": "10", "total_steps": "40", "epoch": "1", "loss": "0.25", "samples_per_s": "1234.57",
        "steps_per_s": "3", "restarts": "0", "goodput": "0.8125"}
    # a script without `steps:`: no percentage, no ETA, no missing numbers sent as "None"
    bare = trainer_status({"state": "running", "step": 3, "total_steps": None, "eta_s": None, "loss": None})
    assert "progressPercentage" not in bare and "estimatedRemainingSeconds" not in bare
    assert bare["metrics"] == [{"name": "step", "value": "3"}]


@pytest.fixture
def server(tmp_path):
    """An HTTPS server on 127.0.0.1 that keeps each POST and answers `answer[0]`."""
    key, crt = tmp_path / "tls.key", tmp_path / "tls.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(crt), "-days", "1", "-subj", "/CN=status",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    posts: list[tuple[str, str, dict]] = []
    answer = [200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            posts.append((self.path, self.headers["Authorization"], body))
            self.send_response(answer[0])
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"message": "Forbidden"}' if answer[0] != 200 else json.dumps(body).encode())

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(crt, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("token-one\n")
    path = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ns/trainjobs/tj/status"
    env = {kubeflow_status.URL_VAR: f"https://127.0.0.1:{httpd.server_address[1]}{path}",
           kubeflow_status.CA_VAR: str(crt), kubeflow_status.TOKEN_VAR: str(token)}
    yield env, posts, answer, token
    httpd.shutdown()


def test_rank_0_posts_running_records_at_most_every_period_and_the_last_at_once(server, monkeypatch):
    env, posts, _, token = server
    monkeypatch.setattr(kubeflow_status, "EVERY_S", 3600.0)
    reporter = StatusReporter.from_env(env)
    reporter.offer(record(1))  # the first: nothing was sent yet
    assert reporter.idle.wait(5)  # sent (a newer record would replace one not yet sent)
    for step in range(2, 20):
        reporter.offer(record(step))  # within the period: dropped
    token.write_text("token-two\n")  # the kubelet rotated the projected token
    reporter.offer(record(40, "completed", eta_s=0.0))  # the last: sent, and waited for
    assert [p[2]["trainerStatus"]["metrics"][0] for p in posts] == [{"name": "step", "value": "1"},
                                                                    {"name": "step", "value": "40"}]
    assert [p[1] for p in posts] == ["Bearer token-one", "Bearer token-two"]
    assert {p[0] for p in posts} == {"/apis/trainer.kubeflow.org/v1alpha1/namespaces/ns/trainjobs/tj/status"}
    assert posts[-1][2]["trainerStatus"]["progressPercentage"] == 100 and reporter.sent == 2


def test_a_refusal_is_said_once_and_training_goes_on(server, capsys):
    env, posts, answer, _ = server
    answer[0] = 403
    reporter = StatusReporter.from_env(env)
    for step in (1, 2):
        reporter.offer(record(step, "stopped"))
    err = capsys.readouterr().err.splitlines()
    assert len(posts) == 2 and reporter.sent == 0
    assert len(err) == 1 and "refused the progress: HTTP Error 403: Forbidden" in err[0], err


def test_no_reporter_without_all_three_variables(server):
    env, *_ = server
    assert StatusReporter.from_env({}) is None
    assert StatusReporter.from_env({k: v for k, v in env.items() if k != kubeflow_status.TOKEN_VAR}) is None


def test_progress_writes_reach_the_reporter(server, tmp_path, monkeypatch):
    from trainer.progress import Ledger, Progress

    env, posts, _, _ = server
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    progress = Progress(tmp_path / "run", Ledger(0.0), total_steps=4, epochs=1, global_batch=8, restarts_allowed=0)
    progress.lines = False
    progress.tick(1, 0)
    assert progress.kubeflow.idle.wait(5)
    progress.publish(4, 0, "completed")
    assert [p[2]["trainerStatus"].get("progressPercentage") for p in posts] == [25, 100]
