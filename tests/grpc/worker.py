"""A grpc (Python grpcio) process driven by the integration tests over
stdin/stdout, one JSON object a line each way: backend servers that answer
with their own name, and xDS channels (`xds:///<service>`) that resolve
through the xDS server of the bootstrap in GRPC_XDS_BOOTSTRAP (or
GRPC_XDS_BOOTSTRAP_CONFIG). grpc reads the bootstrap once per process, so
two xDS clients with their own node ids are two workers.

Requests and their answers:
  {"op": "serve", "names": ["a", "b"]}  -> {"ok": true, "ports": {"a": 40001, "b": 40002}}
  {"op": "call", "target": "xds:///svc", "timeout": 1.0}
      -> {"ok": true, "backend": "a"}
      or {"ok": false, "code": "UNAVAILABLE", "details": "..."}
  {"op": "stop", "name": "a"}           -> {"ok": true}
A request that is not understood is answered {"ok": false, "error": "..."};
the worker exits when stdin closes.
"""

import json
import sys
from concurrent import futures

import grpc

# One method, bytes in and out: no generated code is needed on either side.
SERVICE = "gateway.test.Backend"
METHOD = "Who"
PATH = f"/{SERVICE}/{METHOD}"


def backend(name):
    """A server on 127.0.0.1, port of the kernel's choosing, whose one
    method answers with `name`."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    answer = name.encode()
    handler = grpc.unary_unary_rpc_method_handler(lambda _request, _context: answer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


class Worker:
    def __init__(self):
        self.servers = {}
        self.channels = {}

    def serve(self, names):
        ports = {}
        for name in names:
            if name in self.servers:
                raise ValueError(f"backend {name!r} is already serving")
            server, port = backend(name)
            self.servers[name] = server
            ports[name] = port
        return {"ok": True, "ports": ports}

    def stop(self, name):
        self.servers.pop(name).stop(grace=None).wait()
        return {"ok": True}

    def call(self, target, timeout):
        channel = self.channels.get(target)
        if channel is None:
            channel = self.channels[target] = grpc.insecure_channel(target)
        stub = channel.unary_unary(PATH)
        try:
            answer = stub(b"", timeout=timeout)
        except grpc.RpcError as e:
            return {"ok": False, "code": e.code().name, "details": e.details() or ""}
        return {"ok": True, "backend": answer.decode()}

    def handle(self, request):
        op = request.get("op")
        if op == "serve":
            return self.serve(request["names"])
        if op == "stop":
            return self.stop(request["name"])
        if op == "call":
            return self.call(request["target"], float(request.get("timeout", 1.0)))
        raise ValueError(f"unknown op {op!r}")


def main():
    worker = Worker()
    print(json.dumps({"ok": True, "ready": True, "grpc": grpc.__version__}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = worker.handle(json.loads(line))
        except Exception as e:  # the test reads the reason; the worker goes on
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)
    for channel in worker.channels.values():
        channel.close()
    for server in worker.servers.values():
        server.stop(grace=None)


if __name__ == "__main__":
    main()
