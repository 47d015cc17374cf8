"""A stand-in AWS endpoint on 127.0.0.1 that records every request the AWS CLI sends
and answers the few operations lakeshard's deploy commands call (EMR RunJobFlow and
AddJobFlowSteps, and the DescribeCluster add-steps makes first; EventBridge Scheduler
CreateSchedule) the way the service would, so
the CLI completes. Any other request is answered 400 and recorded, so a test sees it.
Nothing is sent anywhere else: the CLI is pointed here with --endpoint-url."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    target: str | None  # X-Amz-Target (JSON 1.1 protocols: EMR)
    body: dict

    @property
    def operation(self) -> str:
        if self.target:
            return self.target.rsplit(".", 1)[-1]
        if self.method == "POST" and self.path.startswith("/schedules/"):
            return "CreateSchedule"
        return f"{self.method} {self.path}"


class AwsStandIn:
    def __init__(self, release_label: str = "emr-spark-8.0.0") -> None:
        self.requests: list[Request] = []
        self.release_label = release_label  # the cluster DescribeCluster describes
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                req = Request(self.command, self.path.split("?", 1)[0],
                              self.headers.get("X-Amz-Target"),
                              json.loads(raw) if raw.strip() else {})
                outer.requests.append(req)
                op = req.operation
                if op == "RunJobFlow":
                    self._answer(200, {"JobFlowId": "j-STANDIN00001", "ClusterArn":
                                       "arn:aws:elasticmapreduce:us-east-1:123456789012:"
                                       "cluster/j-STANDIN00001"})
                elif op == "DescribeCluster":  # add-steps asks for the release first
                    self._answer(200, {"Cluster": {
                        "Id": req.body.get("ClusterId"), "Name": "lakeshard",
                        "ReleaseLabel": outer.release_label,
                        "Status": {"State": "WAITING"}, "Applications": [{"Name": "Spark"}]}})
                elif op == "AddJobFlowSteps":
                    n = len(req.body.get("Steps", []))
                    self._answer(200, {"StepIds": [f"s-STANDIN{i:05d}" for i in range(n)]})
                elif op == "CreateSchedule":
                    name = req.path.rsplit("/", 1)[-1]
                    self._answer(200, {"ScheduleArn": "arn:aws:scheduler:us-east-1:"
                                       f"123456789012:schedule/default/{name}"})
                else:
                    self._answer(400, {"__type": "ValidationException",
                                       "message": f"stand-in: no answer for {op}"})

            do_POST = do_PUT = do_GET = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> AwsStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def of(self, operation: str) -> list[Request]:
        return [r for r in self.requests if r.operation == operation]
