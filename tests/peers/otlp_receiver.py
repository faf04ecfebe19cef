"""An OTLP/HTTP trace receiver for keel's tests: decodes each export with the official
protobuf definitions (PyPI opentelemetry-proto) and appends every span, as one JSON object per
line, to a file.

    python otlp_receiver.py SPANS_FILE [--fail N]

Prints `listening on PORT` once it accepts connections. `--fail N` answers the first N exports
with 503 (a collector that is down). Each span line: trace_id, span_id, parent_span_id (hex),
name, kind, status_code, status_message, attributes (a JSON object: arrays as lists), service
(the resource's service.name).
"""

import argparse
import http.server
import json
import sys

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


def value_of(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in any_value.array_value.values]
    if kind is None:
        return None
    return getattr(any_value, kind)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("spans_file")
    parser.add_argument("--fail", type=int, default=0)
    args = parser.parse_args()
    failures = [args.fail]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                self.send_response(404)
                self.end_headers()
                return
            if failures[0] > 0:
                failures[0] -= 1
                self.send_response(503)
                self.end_headers()
                return
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            with open(args.spans_file, "a", encoding="utf-8") as out:
                for resource_spans in request.resource_spans:
                    resource = {kv.key: value_of(kv.value) for kv in resource_spans.resource.attributes}
                    for scope_spans in resource_spans.scope_spans:
                        for span in scope_spans.spans:
                            out.write(json.dumps({
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "name": span.name,
                                "kind": span.kind,
                                "status_code": span.status.code,
                                "status_message": span.status.message,
                                "attributes": {kv.key: value_of(kv.value) for kv in span.attributes},
                                "service": resource.get("service.name"),
                            }) + "\n")
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"listening on {server.server_address[1]}", flush=True)
    sys.stdout.close()
    server.serve_forever()


if __name__ == "__main__":
    main()
