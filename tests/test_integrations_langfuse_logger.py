"""The Langfuse plugin: in-memory OTLP spans, and a local receiver decoding the protobuf."""

import gzip
import json
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import tracerl
from tracerl.events.lifecycle import trajectory_finished
from tracerl.events.plugins import get_plugin_manager, register
from tracerl.integrations.langfuse_logger import LangfuseLogger

ROOT = Path(__file__).resolve().parents[1]


def trajectory():
    call = tracerl.LLMCall(id="call-1", rollout_id="ro-lf", model="agent@3", adapter_step=3,
                           request={"messages": [{"role": "user", "content": "2+2?"}]},
                           prompt_token_ids=[1, 2, 3, 4],
                           completions=[tracerl.CompletionRecord(token_ids=[5, 6], text="4")])
    return tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "2+2?"},
                                                    {"role": "assistant", "content": "4"}],
                              reward=0.75, llm_calls=[call], rollout_id="ro-lf")


@pytest.fixture
def registered_logger():
    """A LangfuseLogger exporting to memory, registered as a plugin for the test."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    logger = LangfuseLogger(public_key="pk-test", secret_key="sk-test",
                            base_url="http://127.0.0.1:9", span_exporter=exporter)
    name = register(logger, name="langfuse_logger_test")
    yield logger, exporter
    get_plugin_manager().unregister(name=name)


def test_rollout_becomes_a_trace_with_a_generation_per_call(registered_logger):
    logger, memory_exporter = registered_logger
    trajectory_finished(trajectory())
    logger.flush()
    spans = {s.name: s for s in memory_exporter.get_finished_spans()}
    rollout, gen = spans["rollout"], spans["chat.completions"]
    assert rollout.attributes["langfuse.observation.type"] == "span"
    assert json.loads(rollout.attributes["langfuse.observation.metadata.rollout_id"]) == "ro-lf"
    assert gen.attributes["langfuse.observation.type"] == "generation"
    assert gen.attributes["langfuse.observation.model.name"] == "agent@3"
    assert json.loads(gen.attributes["langfuse.observation.usage_details"]) == {
        "input": 4,
        "output": 2,
    }
    assert gen.parent.span_id == rollout.context.span_id
    assert gen.context.trace_id == rollout.context.trace_id


def test_spans_reach_a_local_otlp_receiver_as_protobuf(tmp_path):
    received = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            received.append((self.path, self.headers.get("Authorization"), body))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        from tests.test_integrations_langfuse_logger import trajectory
        from tracerl.events.lifecycle import trajectory_finished
        from tracerl.events.plugins import get_plugin_manager
        trajectory_finished(trajectory())
        logger = get_plugin_manager().get_plugin("langfuse_logger")
        logger.flush()
        logger.client().shutdown()
    """)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(ROOT),
        "TRACERL_QUIET": "1",
        "TRACERL_LOGGERS": "langfuse",
        "LANGFUSE_PUBLIC_KEY": "pk-lf",
        "LANGFUSE_SECRET_KEY": "sk-lf",
        "LANGFUSE_BASE_URL": f"http://127.0.0.1:{server.server_address[1]}",
    }
    try:
        out = subprocess.run([sys.executable, "-c", code, str(ROOT)], env=env, capture_output=True,
                             text=True, timeout=120)
    finally:
        server.shutdown()
    assert out.returncode == 0, out.stderr[-3000:]
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    otlp = [r for r in received if r[0].endswith("/otel/v1/traces")]
    assert otlp and otlp[0][1].startswith("Basic ")
    names = set()
    for _, _, body in otlp:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        names |= {s.name for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans}
    assert {"rollout", "chat.completions"} <= names
    scores = [json.loads(b) for p, _, b in received if "ingestion" in p or "scores" in p]
    assert scores and "0.75" in json.dumps(scores)
