"""Local OTLP log receivers for tests: gRPC (the proto package's LogsService) and HTTP (/v1/logs).

Both keep every request they accept and can be told to fail or to stall, like a backend in trouble.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc


class Received:
    """What a receiver accepted, and how it should behave next."""

    def __init__(self) -> None:
        self.requests: list[logs_service_pb2.ExportLogsServiceRequest] = []
        self.times: list[float] = []  # time.monotonic() of each accepted request, for the benchmarks
        self.fail = False
        self.delay = 0.0
        self.lock = threading.Lock()

    def log_records(self) -> list[dict[str, Any]]:
        """Every accepted log record with its resource attributes, as plain dicts, in arrival order."""
        out = []
        with self.lock:
            requests = list(self.requests)
        for request in requests:
            for resource_logs in request.resource_logs:
                resource = {a.key: _value(a.value) for a in resource_logs.resource.attributes}
                for scope_logs in resource_logs.scope_logs:
                    for record in scope_logs.log_records:
                        entry = MessageToDict(record, preserving_proto_field_name=True)
                        entry["resource"] = resource
                        entry["attrs"] = {a.key: _value(a.value) for a in record.attributes}
                        entry["body_value"] = _value(record.body)
                        out.append(entry)
        return out


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


class _Servicer(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: Any, context: Any) -> Any:
        time.sleep(self.received.delay)
        if self.received.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "receiver told to fail")
        with self.received.lock:
            self.received.requests.append(request)
            self.received.times.append(time.monotonic())
        return logs_service_pb2.ExportLogsServiceResponse()


class GrpcReceiver:
    def __init__(self, port: int = 0, received: Received | None = None) -> None:
        self.received = received or Received()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(_Servicer(self.received), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=None)


class _HttpHandler(BaseHTTPRequestHandler):
    server: HttpReceiverServer

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        received = self.server.received
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(received.delay)
        if self.path != "/v1/logs" or received.fail:
            self.send_response(404 if self.path != "/v1/logs" else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        request = logs_service_pb2.ExportLogsServiceRequest()
        request.ParseFromString(body)
        with received.lock:
            received.requests.append(request)
            received.times.append(time.monotonic())
        payload = logs_service_pb2.ExportLogsServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class HttpReceiverServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        self.received = Received()
        super().__init__(("127.0.0.1", 0), _HttpHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/logs"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
