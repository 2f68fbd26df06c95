"""A ``rollbox serve`` that a process starts for itself and that ends with it: the managed mode
of :class:`rollbox_sdk.ray.RollboxNode`, usable on its own too.

The daemon gets a scratch directory of its own (its socket, a fresh API key, and its state
unless ``state_dir`` is given), ``--drain-on-sigterm 0`` (a stop ends its sandboxes at once), and
a watcher: a shell that stops it once the starting process is gone, however that process ends.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import subprocess
import tempfile
import time
from typing import Optional, Sequence

import httpx

from .client import Client
from .errors import RollboxError

# Stops the daemon (its pid is $!) once PARENT is gone, and when the watcher itself is stopped.
_WATCH = """
"$@" &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon; exit' TERM INT
while kill -0 "$PARENT" 2>/dev/null && kill -0 $daemon 2>/dev/null; do sleep 1; done
kill -TERM $daemon 2>/dev/null
wait $daemon
"""


class ManagedDaemon:
    """``rollbox serve`` on a socket of its own, stopped by :meth:`stop` or when this process ends."""

    def __init__(
        self,
        binary: str = "rollbox",
        args: Sequence[str] = (),
        *,
        slots: Optional[int] = None,
        state_dir: Optional[str] = None,
        ready_timeout: float = 60.0,
    ) -> None:
        self.dir = tempfile.mkdtemp(prefix="rollbox-managed-")
        self.socket = os.path.join(self.dir, "rollbox.sock")
        self.api_key = secrets.token_hex(24)
        key_file = os.path.join(self.dir, "key")
        with open(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(self.api_key + "\n")
        state = state_dir or os.path.join(self.dir, "state")
        os.makedirs(state, mode=0o700, exist_ok=True)
        command = [binary, "serve", "--socket", self.socket, "--api-key-file", key_file]
        command += ["--state-dir", state, "--drain-on-sigterm", "0"]
        if slots is not None and "--max-sandboxes" not in args:
            command += ["--max-sandboxes", str(slots)]
        command += list(args)
        self.log = os.path.join(self.dir, "serve.log")
        with open(self.log, "ab") as log:
            self._watcher = subprocess.Popen(
                ["sh", "-c", _WATCH, "rollbox-managed", *command],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PARENT": str(os.getpid())},
                start_new_session=True,
            )
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    @classmethod
    def from_env(cls, slots: Optional[int] = None) -> "ManagedDaemon":
        """From ``ROLLBOX_BIN`` (default ``rollbox`` on PATH) and ``ROLLBOX_SERVE_ARGS`` (more
        flags for ``rollbox serve``, shell-quoted)."""
        binary = os.environ.get("ROLLBOX_BIN") or shutil.which("rollbox") or "rollbox"
        args = shlex.split(os.environ.get("ROLLBOX_SERVE_ARGS", ""))
        return cls(binary, args, slots=slots)

    @property
    def pid(self) -> int:
        """The watcher's pid (the daemon is its child)."""
        return self._watcher.pid

    def client(self) -> Client:
        return Client(socket=self.socket, api_key=self.api_key)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        transport = httpx.HTTPTransport(uds=self.socket)
        with httpx.Client(base_url="http://rollbox", transport=transport, timeout=2.0) as http:
            while True:
                if self._watcher.poll() is not None:
                    raise RollboxError(f"rollbox serve ended at start: {self._log_tail()}")
                try:
                    if http.get("/readyz").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RollboxError(f"rollbox serve not ready within {timeout} s: {self._log_tail()}")
                time.sleep(0.1)

    def _log_tail(self) -> str:
        try:
            with open(self.log, "rb") as f:
                return f.read()[-2000:].decode(errors="replace").strip()
        except OSError as e:
            return f"(no log: {e})"

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the daemon (its sandboxes end with it) and removes its scratch directory."""
        if self._watcher.poll() is None:
            self._watcher.terminate()
            try:
                self._watcher.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self._watcher.pid, 9)
                self._watcher.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


__all__ = ["ManagedDaemon"]
