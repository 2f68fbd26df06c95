"""rollbox's code-interpreter server: what the stock `e2b-code-interpreter` SDK calls on port
49999 (`POST /execute` answering NDJSON, and `/contexts`), in front of IPython kernels run
with `jupyter_client` + `ipykernel` (from PyPI, pinned in scripts/e2b-ci-venv.sh). Written for
rollbox; no code of e2b-dev/code-interpreter is in it. Wire facts: shared/docs/e2b-compat.md
section 3b.

Usage: python e2b-code-interpreter-server.py [--host 127.0.0.1] [--port 49999] [--cwd DIR] [--warm]
It prints `listening HOST:PORT` once it serves (port 0: any free port). With --warm the default
context's kernel starts before it listens, so a template's boot snapshot holds a ready kernel.
Each context is one kernel; executions in a context run one at a time. A client that goes
away interrupts its execution.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jupyter_client.manager import KernelManager

# Jupyter MIME types → the fields of the SDK's `Result`.
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
LANGUAGES = ("python", "python3")


class ClientGone(Exception):
    """The HTTP client closed the connection mid-execution."""


class Context:
    """One IPython kernel."""

    def __init__(self, cwd):
        self.id = uuid.uuid4().hex
        self.cwd = cwd
        self.lock = threading.Lock()
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=cwd)
        self.client = self.manager.blocking_client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    def describe(self):
        return {"id": self.id, "language": "python", "cwd": self.cwd}

    def _run(self, code, emit, silent=False):
        """Runs `code`, passing each output line to `emit`; returns when the kernel is idle."""
        msg_id = self.client.execute(code, silent=silent, store_history=not silent, allow_stdin=False)
        interrupted = False
        while True:
            msg = self.client.get_iopub_msg(timeout=None)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            line = None
            if kind == "stream":
                line = {"type": content["name"], "text": content["text"], "timestamp": time.time_ns()}
            elif kind in ("execute_result", "display_data"):
                line = result_line(content.get("data", {}), kind == "execute_result")
            elif kind == "error":
                line = {
                    "type": "error",
                    "name": content["ename"],
                    "value": content["evalue"],
                    "traceback": "\n".join(content.get("traceback", [])),
                }
            elif kind == "execute_input" and not silent:
                line = {"type": "number_of_executions", "execution_count": content["execution_count"]}
            elif kind == "status" and content["execution_state"] == "idle":
                return not interrupted
            if line is not None and not interrupted:
                try:
                    emit(line)
                except ClientGone:
                    self.manager.interrupt_kernel()
                    interrupted = True

    def execute(self, code, env_vars, emit):
        with self.lock:
            if env_vars:
                setup = (
                    "import os as _rollbox_os\n"
                    f"_rollbox_env = {env_vars!r}\n"
                    "_rollbox_saved = {k: _rollbox_os.environ.get(k) for k in _rollbox_env}\n"
                    "_rollbox_os.environ.update(_rollbox_env)\n"
                )
                self._run(setup, lambda _line: None, silent=True)
            try:
                if self._run(code, emit):
                    emit({"type": "end_of_execution"})
            finally:
                if env_vars:
                    restore = (
                        "for _k, _v in _rollbox_saved.items():\n"
                        "    _rollbox_os.environ.pop(_k, None) if _v is None else _rollbox_os.environ.__setitem__(_k, _v)\n"
                    )
                    self._run(restore, lambda _line: None, silent=True)

    def restart(self):
        with self.lock:
            self.manager.restart_kernel()
            self.client.wait_for_ready(timeout=60)

    def shutdown(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def result_line(data, is_main):
    line = {"type": "result", "is_main_result": is_main}
    extra = {}
    for mime, value in data.items():
        field = MIME_FIELDS.get(mime)
        if field:
            line[field] = value
        else:
            extra[mime] = value
    if extra:
        line["extra"] = extra
    return line


class Contexts:
    def __init__(self, cwd):
        self.cwd = cwd
        self.lock = threading.Lock()
        self.by_id = {}
        self.default = None

    def create(self, cwd=None):
        context = Context(cwd or self.cwd)
        with self.lock:
            self.by_id[context.id] = context
        return context

    def get(self, context_id):
        with self.lock:
            return self.by_id.get(context_id)

    def get_default(self):
        with self.lock:
            if self.default is None:
                self.default = Context(self.cwd)
                self.by_id[self.default.id] = self.default
            return self.default

    def remove(self, context_id):
        with self.lock:
            context = self.by_id.pop(context_id, None)
            if context is self.default:
                self.default = None
        if context:
            context.shutdown()
        return context is not None

    def all(self):
        with self.lock:
            return list(self.by_id.values())


class Handler(BaseHTTPRequestHandler):
    server_version = "rollbox-code-interpreter"
    contexts: Contexts = None  # set in main

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def answer(self, status, value):
        body = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def refuse(self, status, message):
        self.answer(status, {"error": message})

    def body(self):
        length = int(self.headers.get("Content-Length") or 0)
        if not length:
            return {}
        try:
            value = json.loads(self.rfile.read(length))
        except ValueError as e:
            raise ValueError(f"the body is not JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError("the body is not a JSON object")
        return value

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/health":
            self.answer(200, {"status": "ok"})
        elif self.path == "/contexts":
            self.answer(200, [c.describe() for c in self.contexts.all()])
        else:
            self.refuse(404, f"no route GET {self.path}")

    def do_DELETE(self):  # noqa: N802
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts":
            if self.contexts.remove(parts[1]):
                self.send_response(204)
                self.end_headers()
            else:
                self.refuse(404, f"context {parts[1]!r} not found")
        else:
            self.refuse(404, f"no route DELETE {self.path}")

    def do_POST(self):  # noqa: N802
        try:
            body = self.body()
        except ValueError as e:
            self.refuse(400, str(e))
            return
        parts = self.path.strip("/").split("/")
        if parts == ["execute"]:
            self.execute(body)
        elif parts == ["contexts"]:
            language = body.get("language") or "python"
            if language not in LANGUAGES:
                self.refuse(400, f"language {language!r}: rollbox's interpreter runs only python")
                return
            self.answer(200, self.contexts.create(body.get("cwd")).describe())
        elif len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            context = self.contexts.get(parts[1])
            if context is None:
                self.refuse(404, f"context {parts[1]!r} not found")
                return
            context.restart()
            self.send_response(204)
            self.end_headers()
        else:
            self.refuse(404, f"no route POST {self.path}")

    def execute(self, body):
        code = body.get("code")
        if not isinstance(code, str):
            self.refuse(400, "code: required, a string")
            return
        language = body.get("language") or "python"
        if language not in LANGUAGES:
            self.refuse(400, f"language {language!r}: rollbox's interpreter runs only python")
            return
        env_vars = body.get("env_vars") or {}
        if not isinstance(env_vars, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
        ):
            self.refuse(400, "env_vars: an object of strings")
            return
        context_id = body.get("context_id")
        if context_id:
            context = self.contexts.get(context_id)
            if context is None:
                self.refuse(404, f"context {context_id!r} not found")
                return
        else:
            context = self.contexts.get_default()
        # Close-delimited NDJSON (HTTP/1.0 answer): each line is sent as it comes.
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.end_headers()

        def emit(line):
            try:
                self.wfile.write(json.dumps(line).encode() + b"\n")
                self.wfile.flush()
            except OSError as e:
                raise ClientGone() from e

        context.execute(code, env_vars, emit)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=49999)
    parser.add_argument("--cwd", default=os.getcwd())
    parser.add_argument("--warm", action="store_true", help="start the default kernel first")
    args = parser.parse_args()
    # SIGTERM ends the kernels too (through the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    Handler.contexts = Contexts(args.cwd)
    if args.warm:
        Handler.contexts.get_default()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    host, port = server.server_address[:2]
    print(f"listening {host}:{port}", flush=True)
    try:
        server.serve_forever()
    finally:
        for context in Handler.contexts.all():
            context.shutdown()


if __name__ == "__main__":
    sys.exit(main())
