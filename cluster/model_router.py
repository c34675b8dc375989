"""The ingress's view of the models it serves: served name -> that model's server handle.

The ingress picks the server from the request's `model` (a served name or an alias):
unknown names are OpenAI's 404, answered here, so no server is asked and no client's name
becomes a metrics label. A request that names no model goes to the only one, or with
several is a 400 listing the names served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from engine.api.errors import APIError, model_not_found, quoted_names


class ModelRouter:
    def __init__(self, servers: Mapping[str, Any], aliases: Mapping[str, str] | None = None):
        """`servers`: served name -> an LLMServer handle (or a LocalServer); `aliases`:
        every name a request may give -> its model's served name (default: the names of
        `servers` alone)."""
        if not servers:
            raise ValueError("a ModelRouter needs at least one server")
        self.servers = dict(servers)
        self.aliases = dict(aliases or {})
        for name in servers:
            self.aliases.setdefault(name, name)
        # .options() starts each handle's router now, so it knows the replicas before the
        # first burst arrives (a cold router queues everything and trips max_queued_requests).
        self.streams = {name: server.options(stream=True) for name, server in servers.items()}
        self._models: dict | None = None

    @property
    def names(self) -> list[str]:
        return list(self.servers)

    def name_for(self, model: str | None) -> str:
        """The served name a request for `model` goes to; APIError 404 / 400 if none."""
        if model is None:
            if len(self.servers) == 1:
                return next(iter(self.servers))
            raise APIError(
                f"this server serves several models ({quoted_names(self.aliases)}): name one in `model`",
                param="model",
            )
        if model not in self.aliases:
            raise model_not_found(model, self.aliases)
        return self.aliases[model]

    def server(self, model: str | None) -> Any:
        return self.servers[self.name_for(model)]

    def stream(self, model: str | None) -> Any:
        """The streaming handle of `model`'s server."""
        return self.streams[self.name_for(model)]

    async def models(self) -> dict:
        """OpenAI's model list: every server's cards, in the order of the config."""
        if self._models is None:
            lists = await asyncio.gather(*(s.models.remote() for s in self.servers.values()))
            cards = [card for found in lists for card in found["data"]]
            self._models = {**lists[0], "data": cards}
        return self._models

    def forget_models(self) -> None:
        """The model list is asked for again (a model switch may have changed it)."""
        self._models = None

    async def model_card(self, model_id: str) -> dict:
        """OpenAI's retrieve-model answer: the card whose id is `model_id`, else a 404."""
        cards = (await self.models())["data"]
        for card in cards:
            if card["id"] == model_id:
                return card
        raise model_not_found(model_id, (card["id"] for card in cards))
