"""The gateway's parts wired together, shared by the HTTP and gRPC front doors.

Built on the main thread before serving; afterwards used only from the event loop, except
the tokenizer threads, which run preprocessing (read-only tokenizer and limits) for it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.metadata
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from services.common.security import read_cluster_secret
from services.gateway.admission.config import directory_of, make_admission
from services.gateway.admission.tenants_watch import TenantsWatcher
from services.gateway.admission.ticket import Ticket
from services.gateway.api.client_address import ClientAddresses
from services.gateway.api.deadline import RequestDeadline, StreamCutoff
from services.gateway.api.preprocess import ModelLimits, Preprocessor
from services.gateway.api.request_body import BodiesInFlight
from services.gateway.api.request_limits import RequestLimits
from services.gateway.api.text_stream import TextDelta, stream_text
from services.gateway.api.tokenizer import ModelTokenizer
from services.gateway.api.tool_parsers import tool_format
from services.gateway.config import GatewayConfig
from services.gateway.errors import APIError
from services.gateway.request_record import RequestObserver, RequestRecord
from services.gateway.routing.circuit_breaker import CircuitBreaker
from services.gateway.routing.config import make_router
from services.gateway.routing.dispatcher import Dispatcher
from services.gateway.routing.prefix_index import PrefixIndex
from services.gateway.routing.registry_follower import RegistryFollower
from services.gateway.routing.router import Router, cached_prompt_tokens, note_admitted_prompt
from services.gateway.routing.worker_pool import WorkerPool
from services.gateway.routing.worker_states import WorkerStates

T = TypeVar("T")
INLINE_INPUT_BYTES = 4096  # parsed and tokenized on the event loop: about 1,000 tokens at most


class Gateway:
    def __init__(self, config: GatewayConfig, router: Router | None = None) -> None:
        self.config = config
        self.started = int(time.time())
        self.tokenizer = ModelTokenizer(config.model)
        self.preprocessor = Preprocessor(self.tokenizer, RequestLimits.from_config(config),
                                         tool_format(config.tool_call_parser))
        # Chat templates and tokenization (milliseconds per KiB of prompt) run here, so one
        # huge prompt cannot hold up every other stream's writes on the event loop.
        self.tokenizer_pool = ThreadPoolExecutor(config.tokenizer_threads,
                                                 thread_name_prefix="tokenizer")
        model_config = json.loads((Path(config.model) / "config.json").read_text()) \
            if (Path(config.model) / "config.json").is_file() else {}
        self._vocab_size = model_config.get("vocab_size") or self.tokenizer.backend.get_vocab_size()
        self._config_max_len = model_config.get("max_position_embeddings") or 2048
        self.prefix_index = PrefixIndex()
        self.pool = WorkerPool(
            prefill_addresses=list(config.prefill), decode_addresses=list(config.decode),
            both_addresses=list(config.worker), poll_interval_s=config.health_interval_s,
            new_breaker=lambda: CircuitBreaker(config.breaker_failures, config.breaker_open_s),
            on_cache_lost=lambda e: self.prefix_index.forget_worker(e.worker_id, e.address),
            on_departed=lambda e: self.observer.metrics.forget_worker(e.address),
            tls=config.tls,
        )
        self.router = router or make_router(config, self.pool, self.prefix_index)
        secret = (read_cluster_secret(config.cluster_secret_file)
                  if config.cluster_secret_file else None)
        self.registry = RegistryFollower(config.redis_url, self.pool, self.prefix_index,
                                         config.registry_interval_s,
                                         secret) if config.redis_url else None
        self.draining = False  # SIGTERM: not ready, finishing the streams it has
        self.cutoff = StreamCutoff()  # and ending those still open a little before the grace ends
        self.bodies = BodiesInFlight()  # request bodies being received (api/request_body.py)
        self.clients = ClientAddresses(config.forwarded_allow_ips)  # who a request is from
        self.dispatcher = Dispatcher(self.router, disaggregated=config.disaggregated,
                                     prefill_timeout_s=config.prefill_timeout_s,
                                     migration_limit=config.migration_limit,
                                     migration_wait_s=config.migration_wait_s)
        # The TTFT estimate counts what a prefill computes: the prompt less what the prefix
        # index says a worker already holds.
        self.admission = make_admission(
            config, self.pool,
            functools.partial(cached_prompt_tokens, self.prefix_index, self.pool),
            functools.partial(note_admitted_prompt, self.prefix_index, self.pool))
        metrics = self.admission.metrics
        metrics.model = config.model_name
        # Quota edits and key rotation without a restart (also on SIGHUP, server.py).
        self.tenants_watch = TenantsWatcher(
            self.admission, functools.partial(directory_of, config),
            [config.tenants_file, config.api_keys_file], config.tenants_reload_s,
            metrics.registry)
        # Request metrics join admission's registry: one /metrics for the whole gateway.
        self.observer = RequestObserver(config.model_name, metrics.registry, config.log_prompts)
        metrics.registry.register(WorkerStates(lambda: self.pool.endpoints))
        if self.registry is not None:
            self.registry.register_metrics(metrics.registry)
        self.model_names = {config.model_name, config.model, str(Path(config.model).resolve())}

    async def start(self) -> None:
        if self.config.structured_outputs_warmup:
            self.tokenizer_pool.submit(self.preprocessor.structured.warm, self._vocab_size)
        await self.pool.start()
        if self.registry is not None:
            await self.registry.start()
        await self.admission.start()
        await self.tenants_watch.start()

    async def close(self) -> None:
        await self.tenants_watch.close()
        await self.admission.close()
        if self.registry is not None:
            await self.registry.close()
        await self.pool.close()
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, size: int, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` (CPU work: parsing, templates, tokenizing) for an input of `size`
        bytes: in a tokenizer thread, or here when it is small enough to take well under a
        millisecond. Under load the thread hop costs more than that: the pool thread and this
        loop contend for the GIL, and each hand-over waits for a turn of a busy loop."""
        if size <= INLINE_INPUT_BYTES:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, functools.partial(fn, *args))

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def limits(self) -> ModelLimits:
        """The workers' context length once they answered Health, else config.json's."""
        return ModelLimits(self._vocab_size, self.pool.max_model_len() or self._config_max_len)

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise APIError.model_not_found(model, self.model_name)

    def choice_streams(self, ticket: Ticket, record: RequestRecord, deadline: RequestDeadline):
        """One text stream per choice of an admitted request (`ticket.specs`), bounded by the
        request's deadline and stall timeout, observed by the request's record."""
        record.admitted(ticket.arrival, ticket.released_at)
        dispatcher = ticket.metered(record.dispatching(self.dispatcher))
        return record.observe([deadline.bound(stream_text(spec, dispatcher, self.tokenizer,
                                                          self._incomplete(spec)))
                               for spec in ticket.specs])

    def _incomplete(self, spec):
        """The judge of a constrained choice's end (StructuredOutputChecker.incomplete)."""
        so = spec.params.structured_output
        if so is None:
            return None
        return functools.partial(self.preprocessor.structured.incomplete, so, self._vocab_size)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.started,
                "owned_by": "splitserve", "root": self.config.model, "parent": None,
                "max_model_len": self.limits().max_model_len,
                # OpenAI's legacy permission object, as vLLM serves it: what the key may do.
                "permission": [{
                    "id": f"modelperm-{self.model_name}", "object": "model_permission",
                    "created": self.started, "allow_create_engine": False,
                    "allow_sampling": True, "allow_logprobs": True,
                    "allow_search_indices": False, "allow_view": True,
                    "allow_fine_tuning": False, "organization": "*", "group": None,
                    "is_blocking": False}]}

    @functools.cached_property
    def version(self) -> str:
        try:
            return importlib.metadata.version("splitserve")
        except importlib.metadata.PackageNotFoundError:
            return "dev"

    @functools.cached_property
    def system_fingerprint(self) -> str:
        """OpenAI's system_fingerprint: changes with what serves the model (its name, the
        weights' path, splitserve's version), so a client can tell when a seed's output
        may have changed."""
        what = f"{self.model_name}\0{self.config.model}\0{self.version}"
        return "fp_" + hashlib.sha256(what.encode()).hexdigest()[:10]


__all__ = ["Gateway", "TextDelta"]
