"""Meters an admitted request's token streams for its admission ticket."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing


class MeteredDispatcher:
    """The dispatcher as one admitted request's choices see it: `on_tokens(count)` as tokens
    come, `on_choice_done()` as each choice has its last one (the request's slot is free when
    all have, not when the client has read the end of the response)."""

    def __init__(self, dispatcher, on_tokens: Callable[[int], None],
                 on_choice_done: Callable[[], None]) -> None:
        self.dispatcher = dispatcher
        self.on_tokens = on_tokens
        self.on_choice_done = on_choice_done

    async def generate(self, request_id, prompt_token_ids, sampling,
                       cache_salt: str = "") -> AsyncIterator:
        async with aclosing(self.dispatcher.generate(request_id, prompt_token_ids, sampling,
                                                     cache_salt=cache_salt)) as events:
            async for event in events:
                if event.token_ids:
                    self.on_tokens(len(event.token_ids))
                if event.finish_reason is not None:
                    self.on_choice_done()
                yield event
