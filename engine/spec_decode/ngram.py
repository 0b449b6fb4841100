"""N-gram (prompt lookup) proposer: find the latest earlier occurrence of the sequence's last
n tokens (n from ngram_max down to ngram_min) and propose the tokens that followed it."""

from __future__ import annotations

from collections.abc import Iterable

from engine.request import Request
from engine.spec_decode.proposer import Proposals, Proposer


class _NgramIndex:
    """For each n, the latest position that followed each n-gram of one request's tokens.
    Tokens are only appended, so the index grows incrementally: O(n range) per new token."""

    __slots__ = ("by_n", "num_indexed")

    def __init__(self, ns: range) -> None:
        self.by_n: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in ns}
        self.num_indexed = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: list[int]) -> None:
        # An n-gram ending at e (inclusive) is indexed once token e + 1 exists, so the
        # sequence's own suffix is never its own match.
        for end in range(self.num_indexed, len(tokens) - 1):
            for n, table in self.by_n.items():
                if end + 1 >= n:
                    table[tuple(tokens[end + 1 - n : end + 1])] = end + 1
        self.num_indexed = max(self.num_indexed, len(tokens) - 1)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in sorted(self.by_n, reverse=True):
            if len(tokens) < n:
                continue
            start = self.by_n[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k]
        return []


class NgramProposer(Proposer):
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ns = range(ngram_min, ngram_max + 1)
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, requests: list[Request], num_tokens: dict[str, int]) -> Proposals:
        proposals = Proposals()
        for request in requests:
            k = num_tokens.get(request.request_id, 0)
            if k <= 0:
                continue
            index = self._indexes.get(request.request_id)
            if index is None:
                index = self._indexes[request.request_id] = _NgramIndex(self.ns)
            tokens = request.all_token_ids
            index.extend(tokens)
            guess = index.lookup(tokens, k)
            if guess:
                proposals.token_ids[request.request_id] = guess
        return proposals

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._indexes.pop(rid, None)

    def retain(self, request_ids: set[str]) -> None:
        for rid in [r for r in self._indexes if r not in request_ids]:
            del self._indexes[rid]
