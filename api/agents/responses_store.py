"""The Responses API's store of finished responses (``store: true``, the default).

Receives each finished response's body and the conversation that led to it
(chat messages, without the instructions); gives them back by id for
``previous_response_id`` (``api.agents.responses_input``) and for ``GET`` /
``DELETE /v1/responses/{id}``. A bounded in-memory LRU, lost on restart.
"""

from __future__ import annotations

import collections
from typing import Any

import attrs

RESPONSE_STORE_SIZE = 256  # finished responses kept for previous_response_id and GET


@attrs.frozen(kw_only=True)
class StoredResponse:
    body: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]  # chat messages through this response, no instructions


class ResponseStore:
    """A bounded LRU of finished responses (in memory, lost on restart)."""

    def __init__(self, max_entries: int = RESPONSE_STORE_SIZE):
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


