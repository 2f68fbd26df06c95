"""``@function``: a Python function run in a sandbox of its own, next to the rollouts.

Beam's and Modal's style::

    from rollbox_sdk import function, Volume

    @function(template="python", gpu="H100", volumes=[Volume("trajectories", "./data")])
    def update_policy(step):
        ...
        return loss

    update_policy.remote(43)              # runs in a fresh sandbox, returns its value
    update_policy.map([1, 2, 3])          # one sandbox each, at once; results in order
    call = update_policy.spawn(44); call.get(timeout=600)

A call creates a sandbox of ``template`` with ``gpu_count`` of the node's GPUs whose name
matches ``gpu`` passed through (``rollbox gpu ls``) and the volumes mounted (a relative
``mount_path`` is under the function's working directory, ``workdir=``, by default
``/workspace``), uploads the
function and its arguments serialised with cloudpickle (and cloudpickle itself, so the
guest needs only ``python3``), runs them there with stdout and stderr streamed to the
caller's, and brings the return value back the same way. The function's own module (not
an installed package) travels by value, so its classes and helpers need not be in the
guest. An exception raised by the
function is raised again in the caller, with the remote traceback as its ``__cause__``. The
sandbox is deleted after the call, and its TTL (``timeout_s`` plus a minute) ends it even if
the caller is killed. The guest's Python must be the caller's major.minor version
(cloudpickle carries bytecode).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import pickle
import sys
import sysconfig
import threading
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import cloudpickle

from ._core import ImageSource
from .client import Client
from .errors import Conflict, NotFound, RollboxError
from .types import Volume

#: Where a call's files live in the sandbox (one directory per call).
_RUN_DIR = "/tmp/rollbox-function"
#: The function's default working directory: relative mount paths are under it.
WORKDIR = "/workspace"
#: How long past ``timeout_s`` a call's sandbox may live (create, upload, download).
_TTL_MARGIN_S = 60

_RUNNER = r'''
import os, sys, traceback
sys.path.insert(0, os.path.join(os.environ["ROLLBOX_FUNCTION_DIR"], "lib"))
import cloudpickle

run_dir = os.environ["ROLLBOX_FUNCTION_DIR"]
with open(os.path.join(run_dir, "call.pkl"), "rb") as f:
    fn, args, kwargs = cloudpickle.load(f)
os.makedirs(os.environ["ROLLBOX_FUNCTION_WORKDIR"], exist_ok=True)
os.chdir(os.environ["ROLLBOX_FUNCTION_WORKDIR"])
try:
    outcome = ("ok", cloudpickle.dumps(fn(*args, **kwargs)))
except BaseException as e:
    text = traceback.format_exc()
    try:
        pickled = cloudpickle.dumps(e)
    except Exception:
        pickled = None
    outcome = ("error", type(e).__qualname__, str(e), text, pickled)
sys.stdout.flush()
sys.stderr.flush()
partial = os.path.join(run_dir, "result.pkl.partial")
with open(partial, "wb") as f:
    cloudpickle.dump(outcome, f)
os.replace(partial, os.path.join(run_dir, "result.pkl"))
'''


class RemoteTraceback(Exception):
    """The traceback of an exception raised in the sandbox (the ``__cause__`` of the
    exception raised again in the caller)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\nRemote traceback:\n" + self.text


class FunctionError(RollboxError):
    """The function raised an exception that could not be brought back as itself, or the
    call failed around it (the sandbox, the upload, the interpreter)."""


def default_template() -> str:
    """The template of a ``@function`` or a Beam ``Sandbox`` that names none:
    ``$ROLLBOX_TEMPLATE``, else ``python``."""
    return os.environ.get("ROLLBOX_TEMPLATE", "python")


def _cloudpickle_files() -> Dict[str, bytes]:
    """cloudpickle's own source files, to upload beside the call: the guest unpickles with the
    very version that pickled."""
    package = os.path.dirname(cloudpickle.__file__)
    files = {}
    for name in sorted(os.listdir(package)):
        if name.endswith(".py"):
            with open(os.path.join(package, name), "rb") as f:
                files[f"lib/cloudpickle/{name}"] = f.read()
    return files


def _is_users_own(module: Any) -> bool:
    """Whether a module is the user's code (not the standard library or an installed
    package): the guest cannot import it, so it travels by value."""
    path = getattr(module, "__file__", None)
    if module.__name__ == "__main__" or not path:
        return False
    path = os.path.realpath(path)
    installed = {
        os.path.realpath(p)
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
    return not any(path.startswith(prefix + os.sep) for prefix in installed)


def _mount(volume: Volume, workdir: str) -> Volume:
    path = volume.mount_path
    if not path.startswith("/"):
        path = os.path.normpath(os.path.join(workdir, path))
    return Volume(volume.name, path, volume.readonly)


class FunctionCall:
    """A call started by :meth:`Function.spawn`."""

    def __init__(self, future: "concurrent.futures.Future[Any]") -> None:
        self._future = future

    def get(self, timeout: Optional[float] = None) -> Any:
        """The function's value (its exception raised again), waiting at most ``timeout``
        seconds (:class:`TimeoutError` past it; the call goes on)."""
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError as e:
            raise TimeoutError(f"the call did not finish within {timeout} s") from e

    def done(self) -> bool:
        return self._future.done()


class Function:
    """A function with the sandbox it runs in; made by :func:`function`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        template: Optional[str],
        image: Union[str, ImageSource, None],
        kernel: Optional[str],
        gpu: Optional[str],
        gpu_count: Optional[int],
        gpu_wait_s: Optional[int],
        cpu: Optional[float],
        memory_mib: Optional[int],
        volumes: Sequence[Volume],
        timeout_s: int,
        env: Optional[Mapping[str, str]],
        client: Optional[Client],
        python: str,
        workdir: str,
    ) -> None:
        if not workdir.startswith("/"):
            raise ValueError(f"workdir: {workdir!r} is not an absolute path")
        if image is not None and template is not None:
            raise ValueError("image=, template=: give one (an image becomes a template)")
        if kernel is not None and image is None:
            raise ValueError("kernel=: only with image= (a template has its own kernel)")
        self.image = ImageSource(reference=image) if isinstance(image, str) else image
        self.kernel = kernel
        # With an image, the template is made from it at the first call.
        template = template or (None if image is not None else default_template())
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: {timeout_s} is not a positive number of seconds")
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.template = template
        self.gpu = gpu
        self.gpu_count = gpu_count
        self.gpu_wait_s = gpu_wait_s
        self.cpu = cpu
        self.memory_mib = memory_mib
        self.workdir = workdir
        self.volumes = [_mount(v, workdir) for v in volumes]
        self.timeout_s = timeout_s
        self.env = dict(env or {})
        self.python = python
        self._client = client
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A local call, as if undecorated."""
        return self._fn(*args, **kwargs)

    def client(self) -> Client:
        """The client calls go through: the one given, else one from the environment
        (``$ROLLBOX_URL`` or ``$ROLLBOX_SOCKET``, ``$ROLLBOX_API_KEY``), made once."""
        with self._lock:
            if self._client is None:
                self._client = Client()
            return self._client

    def _template(self, client: Client) -> str:
        """The template calls run in: the one given, or one built once from ``image`` (with a
        boot snapshot, named by a hash of the image and the kernel, so every process that
        decorates the same image shares it)."""
        with self._lock:
            if self.template is not None:
                return self.template
            assert self.image is not None
            kernel = self.kernel
            if kernel is None:
                base = default_template()
                try:
                    kernel = client.get_template(base).kernel
                except NotFound as e:
                    raise ValueError(
                        f"image=: give kernel= (a guest kernel on the daemon's host), or register "
                        f"template {base!r} ($ROLLBOX_TEMPLATE), whose kernel images then boot"
                    ) from e
            key = json.dumps([self.image.to_json(), kernel, self.memory_mib], sort_keys=True)
            name = "fn-" + hashlib.sha256(key.encode()).hexdigest()[:16]
            try:
                client.get_template(name)
            except NotFound:
                try:
                    client.add_template(
                        name,
                        kernel,
                        image=self.image,
                        boot_snapshot=True,
                        memory_mib=self.memory_mib,
                    )
                except Conflict:
                    pass  # another process made it meanwhile
            self.template = name
            return name

    def _ensure_volumes(self, client: Client) -> None:
        for volume in self.volumes:
            try:
                client.create_volume(volume.name)
            except Conflict:
                pass

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the function in a fresh sandbox and returns its value; stdout and stderr
        stream to this process's as they come."""
        client = self.client()
        template = self._template(client)
        self._ensure_volumes(client)
        module = sys.modules.get(self._fn.__module__)
        if module is not None and _is_users_own(module):
            # Its classes and helpers go with it (the guest has the interpreter, not the code).
            cloudpickle.register_pickle_by_value(module)
        payload = cloudpickle.dumps((self._fn, args, kwargs))
        sandbox = client.create_sandbox(
            template,
            memory_mib=self.memory_mib,
            cpu_limit=self.cpu,
            ttl_s=self.timeout_s + _TTL_MARGIN_S,
            env=self.env,
            volumes=self.volumes or None,
            gpu=self.gpu,
            gpu_count=self.gpu_count,
            gpu_wait_s=self.gpu_wait_s,
            labels={"rollbox.function": self.__name__[:63] or "function"},
        )
        try:
            return self._run(client, sandbox.id, payload)
        finally:
            client.delete_sandbox(sandbox.id)

    def _run(self, client: Client, sandbox: str, payload: bytes) -> Any:
        run_dir = f"{_RUN_DIR}-{os.urandom(8).hex()}"
        files = dict(_cloudpickle_files())
        files["runner.py"] = _RUNNER.encode()
        files["call.pkl"] = payload
        for name, data in files.items():
            client.write_file(sandbox, f"{run_dir}/{name}", data, parents=True)
        try:
            return self._call(client, sandbox, run_dir)
        finally:
            try:
                client.remove(sandbox, run_dir, recursive=True)
            except RollboxError:
                pass

    def _call(self, client: Client, sandbox: str, run_dir: str) -> Any:
        env = {"ROLLBOX_FUNCTION_DIR": run_dir, "ROLLBOX_FUNCTION_WORKDIR": self.workdir}
        stream = client.stream(
            sandbox,
            [self.python, f"{run_dir}/runner.py"],
            env=env,
            timeout_s=self.timeout_s,
        )
        exit_info = None
        for event in stream:
            if event.type == "stdout":
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif event.type == "stderr":
                sys.stderr.write(event.text)
                sys.stderr.flush()
            elif event.type == "exit":
                exit_info = event.exit
            elif event.type == "error":
                raise FunctionError(f"{self.__name__}: the exec failed: {event.message}")
        try:
            result = client.read_file(sandbox, f"{run_dir}/result.pkl")
        except RollboxError as e:
            if exit_info is not None and exit_info.timed_out:
                raise TimeoutError(
                    f"{self.__name__} did not return within timeout_s={self.timeout_s}"
                ) from e
            raise FunctionError(
                f"{self.__name__}: the sandbox's {self.python} left no result ({exit_info}); "
                "its stderr is above"
            ) from e
        outcome = pickle.loads(result)
        if outcome[0] == "ok":
            return pickle.loads(outcome[1])
        _, kind, message, text, pickled = outcome
        error: Optional[BaseException] = None
        if pickled is not None:
            try:
                error = pickle.loads(pickled)
            except Exception:
                error = None
        if not isinstance(error, BaseException):
            error = FunctionError(f"{self.__name__} raised {kind}: {message}")
        error.__cause__ = RemoteTraceback(text)
        raise error

    def spawn(self, *args: Any, **kwargs: Any) -> FunctionCall:
        """Starts a call in the background: :meth:`FunctionCall.get` waits for its value."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        future = pool.submit(self.remote, *args, **kwargs)
        pool.shutdown(wait=False)
        return FunctionCall(future)

    def map(self, inputs: Iterable[Any], *, concurrency: int = 16) -> List[Any]:
        """Calls the function on each input, each in its own sandbox, ``concurrency`` at
        once; the values in input order (the first exception is raised)."""
        items = list(inputs)
        if not items:
            return []
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, min(concurrency, len(items)))
        ) as pool:
            return list(pool.map(self.remote, items))


def function(
    fn: Optional[Callable[..., Any]] = None,
    *,
    template: Optional[str] = None,
    image: Union[str, ImageSource, None] = None,
    kernel: Optional[str] = None,
    gpu: Optional[str] = None,
    gpu_count: Optional[int] = None,
    gpu_wait_s: Optional[int] = None,
    cpu: Optional[float] = None,
    memory_mib: Optional[int] = None,
    volumes: Sequence[Volume] = (),
    timeout_s: int = 600,
    env: Optional[Mapping[str, str]] = None,
    client: Optional[Client] = None,
    python: str = "python3",
    workdir: str = WORKDIR,
) -> Any:
    """Makes ``fn`` a :class:`Function`: ``@function(template=...)``, ``@function(image=...)``
    or ``@function`` (``template`` defaults to ``$ROLLBOX_TEMPLATE``, else ``python``). An
    ``image`` (a registry reference, or an :class:`ImageSource`) becomes a template with a
    boot snapshot at the first call, booting ``kernel`` (default: the default template's)."""

    def wrap(f: Callable[..., Any]) -> Function:
        return Function(
            f,
            template=template,
            image=image,
            kernel=kernel,
            gpu=gpu,
            gpu_count=gpu_count,
            gpu_wait_s=gpu_wait_s,
            cpu=cpu,
            memory_mib=memory_mib,
            volumes=volumes,
            timeout_s=timeout_s,
            env=env,
            client=client,
            python=python,
            workdir=workdir,
        )

    return wrap(fn) if fn is not None else wrap
