"""Model control for many replicas: the load/unload requests every replica must apply.

Explicit model control (``POST /v2/repository/models/{name}/load``) reaches one replica through
Ray Serve's proxy; the other replicas must follow. `ModelControl` (a one-replica Serve
deployment) holds the *desired* state: for every model loaded or unloaded through the API, the
latest action and a token naming it. Each inference replica long-polls `ModelControl.sync`,
applies the actions whose token it has not applied, and reports what it applied, so:

- a replica that starts later (a restart after a crash, or autoscaling) catches up before it
  takes traffic: it applies the desired state of every model named in it;
- the replica that took the request waits (`ModelControl.wait_applied`) until every live replica
  has applied the action, and answers with the failures of the others, if any;
- if `ModelControl` itself restarts (its state is in memory), the first replica that syncs gives
  it back the state that replica applied.

This module does not import Ray: `asyncinfer.serving.ray` wraps the class in a Serve deployment.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

__all__ = ["ModelControl", "Action", "Applied", "HEARTBEAT", "LIVENESS"]

# Seconds a replica's sync call waits for news before it returns (and the replica calls again).
HEARTBEAT = 2.0
# A replica not heard from for this long is taken for dead: a fan-out no longer waits for it.
LIVENESS = 3 * HEARTBEAT

# {"action": "load" | "unload", "config": JSON text or None, "token": str}
Action = dict[str, Any]
# an Action plus "error": why applying it failed on that replica ("" when it did not)
Applied = dict[str, Any]


class ModelControl:
    """The desired model state of one Ray Serve application, and what each replica applied."""

    def __init__(self) -> None:
        self.epoch = uuid.uuid4().hex  # a restart has another: replicas then resend what they applied
        self.desired: dict[str, Action] = {}
        self.changed = False  # any action since this instance started (then no state is adopted)
        self._applied: dict[str, dict[str, Applied]] = {}  # replica -> model -> what it applied
        self._seen: dict[str, float] = {}  # replica -> when it last synced
        self._polling: dict[str, int] = {}  # replica -> sync calls waiting now
        self._news = asyncio.Condition()

    async def publish(self, replica: str, name: str, action: str, config: str | None) -> str:
        """Record ``action`` on ``name``, already applied by ``replica`` (the one that took the
        request); returns its token. Wakes every waiting replica."""
        if action not in ("load", "unload"):
            raise ValueError(f"action is 'load' or 'unload', got {action!r}")
        token = uuid.uuid4().hex
        entry: Action = {"action": action, "config": config, "token": token}
        async with self._news:
            self.desired[name] = entry
            self.changed = True
            self._applied.setdefault(replica, {})[name] = {**entry, "error": ""}
            self._seen[replica] = time.monotonic()
            self._news.notify_all()
        return token

    async def sync(self, replica: str, epoch: str, applied: dict[str, Applied],
                   wait: float = HEARTBEAT) -> tuple[str, dict[str, Action]]:
        """Report what ``replica`` applied; returns ``(epoch, desired)`` at once when the replica has
        something to apply, else after up to ``wait`` seconds (or as soon as there is news)."""
        async with self._news:
            if epoch and epoch != self.epoch and not self.changed and applied and not self.desired:
                # this instance restarted and lost its state: the replica's is the latest known
                self.desired = {name: {k: a[k] for k in ("action", "config", "token")} for name, a in applied.items()}
            self._applied[replica] = dict(applied)
            self._seen[replica] = time.monotonic()
            self._news.notify_all()  # a fan-out may be waiting for this replica
            if not self._behind(replica) and wait > 0:
                self._polling[replica] = self._polling.get(replica, 0) + 1
                try:
                    await asyncio.wait_for(self._news.wait_for(lambda: self._behind(replica)), wait)
                except asyncio.TimeoutError:
                    pass
                finally:
                    self._polling[replica] -= 1
                    self._seen[replica] = time.monotonic()
            return self.epoch, dict(self.desired)

    async def wait_applied(self, name: str, token: str, timeout: float) -> dict[str, Any]:
        """Wait until every live replica applied ``token`` on ``name`` (or ``timeout`` seconds).

        Returns ``{"replicas": n, "failed": {replica: error}, "missing": [replicas that had not
        applied it in time]}``."""
        deadline = time.monotonic() + timeout
        async with self._news:
            while True:
                live = self._live()
                missing = [r for r in live if self._applied.get(r, {}).get(name, {}).get("token") != token]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    break
                try:  # a replica that died drops out of `live` once LIVENESS has passed
                    await asyncio.wait_for(self._news.wait(), min(left, HEARTBEAT))
                except asyncio.TimeoutError:
                    pass
            failed = {r: applied[name]["error"] for r in live
                      if (applied := self._applied.get(r, {})).get(name, {}).get("token") == token
                      and applied[name]["error"]}
            return {"replicas": len(live), "failed": failed, "missing": missing}

    def _behind(self, replica: str) -> bool:
        mine = self._applied.get(replica, {})
        return any(mine.get(name, {}).get("token") != action["token"] for name, action in self.desired.items())

    def _live(self) -> list[str]:
        now = time.monotonic()
        for replica in [r for r, seen in self._seen.items()
                        if now - seen > LIVENESS and not self._polling.get(r)]:
            del self._seen[replica]  # gone: forget it, so the tables do not grow with restarts
            self._applied.pop(replica, None)
            self._polling.pop(replica, None)
        return sorted(self._seen)
