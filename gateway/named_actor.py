"""The client side of a named, detached actor that every Serve replica of an application shares
(the response store, the metrics board, the KV directory): created by whichever replica comes
first, found by the others under its name, and created again, empty, when a call finds it gone."""

from __future__ import annotations

import logging
from typing import Any

from ray.exceptions import RayActorError

log = logging.getLogger(__name__)


class NamedActorClient:
    def __init__(self, name: str) -> None:
        self.name = name
        self.actor = self._connect()

    def _connect(self) -> Any:  # noqa: ANN401 - a Ray actor handle
        """The named actor, created if there is none (a first replica, or the last one died)."""
        raise NotImplementedError

    async def _call(self, method: str, *args: Any) -> Any:  # noqa: ANN401 - the actor method's answer
        try:
            return await getattr(self.actor, method).remote(*args)
        except RayActorError:
            log.warning("%s is gone; starting it again, empty", self.name)
            self.actor = self._connect()
            return await getattr(self.actor, method).remote(*args)
