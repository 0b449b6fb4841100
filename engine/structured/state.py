"""One request's place in its grammar: an llguidance matcher that has consumed the request's
output tokens. Rebuilt from the tokens wherever a runner first sees the request (a prefill
worker, the decode worker it hands off to, a recompute after preemption, a migration), so the
state needs no transport of its own: it is a function of the constraint and the outputs."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.sampling_params import StructuredOutput
from engine.structured.grammar import GrammarCompiler, GrammarError

log = logging.getLogger(__name__)


class GrammarState:
    """Owned by the engine thread (ModelRunner). `failed` is set, with a reason, when the
    grammar did not compile or a token outside it was fed in (outputs generated without the
    constraint, e.g. by a worker that ignored it): such a request is only offered EOS."""

    def __init__(self, compiler: GrammarCompiler, so: StructuredOutput,
                 output_token_ids: Sequence[int], request_id: str = "") -> None:
        self.request_id = request_id
        self.matcher_eos = frozenset(compiler.tokenizer.eos_tokens)
        self.failed: str | None = None
        try:
            self.matcher = compiler.matcher(so)
        except GrammarError as exc:  # a peer that skipped the gateway's check sent it
            self.matcher = None
            self.failed = str(exc)
            log.warning("request %s: structured output %s; only EOS is allowed", request_id, exc)
            return
        if self.matcher.is_error():
            self._fail("the grammar did not compile")
        elif output_token_ids:
            self.accept(output_token_ids)

    def accept(self, token_ids: Sequence[int]) -> None:
        """Advance past tokens sampled under this grammar's masks. A finished grammar offers
        only EOS, which the matcher does not consume: it is skipped here."""
        for token in token_ids:
            if self.failed is not None:
                return
            if self.matcher.is_stopped() and token in self.matcher_eos:
                continue
            if not self.matcher.consume_token(token):
                self._fail(f"token {token} is outside the grammar")

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, if they came next, the grammar accepts (the state is left
        as it is)."""
        if self.failed is not None or self.matcher.is_stopped():
            return 0
        return self.matcher.validate_tokens(list(token_ids))

    def _fail(self, reason: str) -> None:
        # llguidance's error text ends in a dump of the parser state: keep its first line.
        error = self.matcher.get_error().split("\n", 1)[0]
        self.failed = f"{reason} ({error})" if error else reason
        log.warning("request %s: structured output %s; only EOS is allowed from here",
                    self.request_id, reason)
