"""The gateway's parts wired together, shared by the HTTP and gRPC front doors.

Built on the main thread before serving; afterwards used only from the event loop.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from services.gateway.admission import Admission
from services.gateway.config import GatewayConfig
from services.gateway.dispatcher import Dispatcher
from services.gateway.errors import APIError
from services.gateway.preprocess import GenerationSpec, ModelLimits, Preprocessor
from services.gateway.router import LeastLoadedRouter, Router
from services.gateway.text_stream import TextDelta, stream_text
from services.gateway.tokenizer import ModelTokenizer
from services.gateway.worker_pool import WorkerPool


class Gateway:
    def __init__(self, config: GatewayConfig, router: Router | None = None) -> None:
        self.config = config
        self.started = int(time.time())
        self.tokenizer = ModelTokenizer(config.model)
        self.preprocessor = Preprocessor(self.tokenizer)
        model_config = json.loads((Path(config.model) / "config.json").read_text()) \
            if (Path(config.model) / "config.json").is_file() else {}
        self._vocab_size = model_config.get("vocab_size") or self.tokenizer.backend.get_vocab_size()
        self._config_max_len = model_config.get("max_position_embeddings") or 2048
        self.pool = WorkerPool(
            prefill_addresses=list(config.prefill), decode_addresses=list(config.decode),
            both_addresses=list(config.worker), poll_interval_s=config.health_interval_s,
        )
        self.router = router or LeastLoadedRouter(self.pool)
        self.dispatcher = Dispatcher(self.router, disaggregated=config.disaggregated,
                                     prefill_timeout_s=config.prefill_timeout_s)
        self.admission = Admission(config.api_keys, config.max_inflight,
                                   config.max_inflight_per_key)
        self.model_names = {config.model_name, config.model, str(Path(config.model).resolve())}

    async def start(self) -> None:
        await self.pool.start()
        self.dispatcher.block_size = self.pool.block_size()

    async def close(self) -> None:
        await self.pool.close()

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def limits(self) -> ModelLimits:
        """The workers' context length once they answered Health, else config.json's."""
        return ModelLimits(self._vocab_size, self.pool.max_model_len() or self._config_max_len)

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise APIError.model_not_found(model, self.model_name)

    def choice_streams(self, specs: list[GenerationSpec]):
        return [stream_text(spec, self.dispatcher, self.tokenizer) for spec in specs]

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.started,
                "owned_by": "splitserve", "root": self.config.model, "parent": None,
                "max_model_len": self.limits().max_model_len}


__all__ = ["Gateway", "TextDelta"]
