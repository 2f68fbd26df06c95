"""A verl tool backed by rollbox sandboxes placed by :mod:`rollbox_sdk.ray`'s pool.

verl's agent loop calls a tool's ``create`` once per trajectory, ``execute`` per tool call,
``calc_reward`` and ``release`` at the end (``verl.tools.base_tool.BaseTool``). This one gives
each trajectory a sandbox on the agent loop's own node when it can and runs the call's code
there. In verl's tool config::

    tools:
      - class_name: rollbox_sdk.verl.RollboxTool
        config: {template: python, pool: rollouts, command: [python3, -c], timeout_s: 30}

It subclasses verl's ``BaseTool`` when verl is installed, and stands alone otherwise.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Dict, List, Optional, Tuple

import ray

from .ray import Lease, pool

try:  # pragma: no cover - verl is optional
    from verl.tools.base_tool import BaseTool as _Base
    from verl.tools.schemas import ToolResponse as _Response
except ImportError:  # pragma: no cover
    _Base = object
    _Response = None


class RollboxTool(_Base):  # type: ignore[misc, valid-type]
    """``config``: ``template`` (required), ``pool`` (default ``"default"``), ``command`` the
    argv the code is appended to (default ``["python3", "-c"]``), ``timeout_s`` per call."""

    def __init__(self, config: Dict[str, Any], tool_schema: Any = None) -> None:
        if _Base is not object:
            super().__init__(config, tool_schema)
        self._template = config["template"]
        self._pool = pool(config.get("pool", "default"))
        self._command: List[str] = list(config.get("command", ["python3", "-c"]))
        self._timeout_s: Optional[float] = config.get("timeout_s")
        self._leases: Dict[str, Lease] = {}

    async def create(self, instance_id: Optional[str] = None, **kwargs: Any) -> str:
        instance_id = instance_id or uuid.uuid4().hex
        here = ray.get_runtime_context().get_node_id()
        self._leases[instance_id] = await self._pool.create.remote(self._template, near=here)
        return instance_id

    async def execute(
        self, instance_id: str, parameters: Dict[str, Any], **kwargs: Any
    ) -> Tuple[Any, float, Dict[str, Any]]:
        lease = self._leases[instance_id]
        argv = self._command + [str(parameters.get("code", ""))]
        result = await asyncio.to_thread(lease.run, argv, timeout_s=self._timeout_s)
        text = result.stdout + result.stderr
        metrics = {"exit_code": result.exit_code, "timed_out": result.timed_out}
        return (_Response(text=text) if _Response else text), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        lease = self._leases.pop(instance_id, None)
        if lease is not None:
            await self._pool.release.remote(lease)


__all__ = ["RollboxTool"]
