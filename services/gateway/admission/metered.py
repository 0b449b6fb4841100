"""Meters an admitted request's token streams against its admission ticket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.gateway.admission.admission import Ticket


class MeteredDispatcher:
    """The dispatcher as one ticket's choices see it: tokens are counted as they come, and
    the ticket is released when every choice has its last token (its slot is free then, not
    when the client has read the end of the response)."""

    def __init__(self, dispatcher, ticket: Ticket) -> None:
        self.dispatcher = dispatcher
        self.ticket = ticket

    async def generate(self, request_id, prompt_token_ids, sampling,
                       cache_salt: str = "") -> AsyncIterator:
        ticket = self.ticket
        async with aclosing(self.dispatcher.generate(request_id, prompt_token_ids, sampling,
                                                     cache_salt=cache_salt)) as events:
            async for event in events:
                if event.token_ids:
                    ticket._tokens(len(event.token_ids))
                if event.finish_reason is not None:
                    ticket.finished_choices += 1
                    if ticket.finished_choices == ticket.slots:
                        ticket.release()
                yield event
