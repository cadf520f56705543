"""Progress for Kubeflow Trainer's TrainJob status server, so `kubectl get trainjob` shows it.

With its `TrainJobStatus` feature gate on (alpha in Trainer v2.3), Trainer's controller gives
every trainer container of a TrainJob three variables: the URL of its status endpoint
(`KUBEFLOW_TRAINER_SERVER_URL`), the CA of the server's certificate and a projected service
account token whose audience is that one TrainJob (both as file paths). Whoever POSTs
`{"trainerStatus": {...}}` there with the token as a Bearer credential sets the TrainJob's
`status.trainerStatus`: progress in percent, seconds remaining, metrics as strings, the time.

ddpkit reports from rank 0's progress record (trainer/progress.py), for the built-in trainer
and for script jobs alike, so a user's code reports with no change: on a thread of its own (a
training step never waits on the network), at most every `EVERY_S` while running, and the last
record (completed or stopped) at once, waited for up to `FINAL_WAIT_S` (a busy server, or a
busy node, must not lose the 100%). Without the variables
(another flavor, another target, the gate off) nothing is sent. A failed POST is said once on
stderr and training goes on; the record in the log stays what `ddpkit status` reads.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

URL_VAR, CA_VAR, TOKEN_VAR = ("KUBEFLOW_TRAINER_SERVER_URL", "KUBEFLOW_TRAINER_SERVER_CA_CERT",
                              "KUBEFLOW_TRAINER_SERVER_TOKEN")
EVERY_S = 10.0  # as often as the `ddpkit-progress` log line
FINAL_WAIT_S = 20.0  # a finished job waits this long at most for its last record to be taken
TIMEOUT_S = 10.0
#: the record's numbers sent as metrics (Trainer's Metric: name and value, strings of <= 64)
METRICS = ("step", "total_steps", "epoch", "loss", "samples_per_s", "steps_per_s", "restarts")


def trainer_status(record: Mapping[str, Any]) -> dict[str, Any]:
    """The `trainerStatus` of one progress record."""
    status: dict[str, Any] = {}
    total, step = record.get("total_steps"), record.get("step") or 0
    if total:
        status["progressPercentage"] = max(0, min(100, int(100 * step / total)))
    eta = record.get("eta_s")
    if eta is not None:
        status["estimatedRemainingSeconds"] = max(0, round(eta))
    metrics = [{"name": name, "value": _text(record[name])} for name in METRICS if record.get(name) is not None]
    goodput = (record.get("run") or {}).get("goodput")
    if goodput is not None:
        metrics.append({"name": "goodput", "value": _text(goodput)})
    status["metrics"] = metrics
    status["lastUpdatedTime"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.get("updated") or time.time()))
    return status


def _text(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


class StatusReporter:
    """Sends the newest record to the status server from a daemon thread."""

    def __init__(self, url: str, ca_file: str, token_file: str) -> None:
        # here, not at the top: the module is imported by every rank 0, most of which never
        # report; and now, not at the last POST, which a finished worker waits for
        import ssl
        import urllib.request  # noqa: F401

        self.url, self.token_file = url, token_file
        self.context = ssl.create_default_context(cafile=ca_file)
        self.sent_at = -EVERY_S  # when the last record was queued
        self.pending: Mapping[str, Any] | None = None
        self.sent = 0  # POSTs the server accepted
        self.failed: str | None = None  # the first failure, said once
        self.wake = threading.Condition()
        self.idle = threading.Event()
        self.idle.set()
        threading.Thread(target=self._loop, name="ddpkit-kubeflow-status", daemon=True).start()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> StatusReporter | None:
        """A reporter when Trainer's controller gave this container its status endpoint."""
        if not all(env.get(v) for v in (URL_VAR, CA_VAR, TOKEN_VAR)):
            return None
        return cls(env[URL_VAR], env[CA_VAR], env[TOKEN_VAR])

    def offer(self, record: Mapping[str, Any]) -> None:
        """The newest record: sent when EVERY_S passed since the last POST, or at once and
        waited for when the attempt ended (state not `running`)."""
        final = record.get("state") != "running"
        if not final and time.monotonic() - self.sent_at < EVERY_S:
            return
        with self.wake:
            self.pending, self.sent_at = record, time.monotonic()  # a newer record replaces one not yet sent
            self.idle.clear()
            self.wake.notify()
        if final and not self.idle.wait(FINAL_WAIT_S):
            print(f"ddpkit: Kubeflow Trainer's status server ({self.url}) took the last progress "
                  f"record in no {FINAL_WAIT_S:.0f} s: the TrainJob's trainerStatus may stay behind",
                  file=sys.stderr, flush=True)

    def _loop(self) -> None:
        while True:
            with self.wake:
                while self.pending is None:
                    self.idle.set()
                    self.wake.wait()
                record, self.pending = self.pending, None
            self._post(record)

    def _post(self, record: Mapping[str, Any]) -> None:
        import urllib.error
        import urllib.request

        body = json.dumps({"trainerStatus": trainer_status(record)}).encode()
        try:
            with open(self.token_file) as f:  # projected: the kubelet rotates it
                token = f.read().strip()
            request = urllib.request.Request(self.url, data=body, method="POST", headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self.context) as answer:
                answer.read()
            self.sent += 1
        except (OSError, urllib.error.URLError, ValueError) as e:
            if self.failed is None:
                detail = e.read().decode(errors="replace")[:200] if isinstance(e, urllib.error.HTTPError) else ""
                self.failed = f"{e} {detail}".strip()
                print(f"ddpkit: Kubeflow Trainer's status server ({self.url}) refused the progress: "
                      f"{self.failed}; `ddpkit status` still reads it from the log", file=sys.stderr, flush=True)
