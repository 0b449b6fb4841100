"""The model's tokenizer as the gateway needs it: encode, decode, per-token bytes and the chat
template, from tokenizer.json / tokenizer_config.json alone (no transformers, no torch)."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

_GIL_FREE_ENCODE_CHARS = 16 << 10


class TextTooLong(ValueError):
    """A text with more characters than `max_tokens` tokens of this vocabulary can hold."""

    def __init__(self, chars: int, min_tokens: int) -> None:
        super().__init__(f"{chars} characters")
        self.chars, self.min_tokens = chars, min_tokens


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the model's chat template."""


class ModelTokenizer:
    """Read-only after construction; safe to share across the event loop and worker threads."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_file = model_dir / "tokenizer_config.json"
        self.config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = self.config.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self._template = _compile_template(template) if template else None
        # Templates with tool support read a `tools` variable (Qwen2.5, Llama 3.1, Hermes);
        # for the others api/tools.py writes the tools and calls into plain messages.
        self.template_renders_tools = bool(template) and _reads_tools(template)
        self._byte_level = _uses_byte_level(self.backend.decoder)
        self._token_bytes: dict[int, bytes] = {}
        added = self.backend.get_added_tokens_decoder()
        self._special_ids = frozenset(token_id for token_id, token in added.items() if token.special)
        self._added_text = {token_id: token.content for token_id, token in added.items()}

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters one token can stand for: no text of more than this many times
        N characters is N tokens or fewer. The vocabulary's strings (a byte-level BPE's hold a
        character per byte, a SentencePiece's a character per character or a byte's "<0xNN>")
        are at least as long as the text they decode to; a normalizer may compose characters
        (NFC, NFKC: at most 3 into 1), hence the margin. Read on first use (26 ms for a 49k
        vocabulary): cached_property's write is idempotent, so threads may race to it."""
        longest = max((len(piece) for piece in self.backend.get_vocab(with_added_tokens=True)),
                      default=1)
        return longest * (1 if self.backend.normalizer is None else 4)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True,
               max_tokens: int | None = None) -> list[int]:
        """`max_tokens`: raise TextTooLong, without encoding, for a text too long to be that
        few tokens (a multi-megabyte prompt took a tokenizer thread 20-30 s only to be
        refused for its length; one that passes is at most that many tokens' worth)."""
        if max_tokens is not None and len(text) > max_tokens * self.max_chars_per_token:
            raise TextTooLong(len(text), -(-len(text) // self.max_chars_per_token))
        if len(text) >= _GIL_FREE_ENCODE_CHARS:
            # `Tokenizer.encode` holds the GIL throughout (seconds for megabytes of text),
            # which would stall the event loop even from a tokenizer thread; `encode_batch`
            # releases it. Same ids; kept for long texts, where its overhead does not show.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """`template_kwargs`: more variables for the template (vLLM's chat_template_kwargs,
        e.g. enable_thinking); they cannot replace the ones set here."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        variables = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                     **self._special_token_strings(), **({"tools": tools} if tools else {})}
        taken = sorted(set(template_kwargs or ()) & {*variables, "tools"})
        if taken:
            raise ChatTemplateError(f"chat_template_kwargs cannot set {', '.join(taken)}: "
                                    "the request's own fields set them")
        try:
            return self._template.render(**variables, **(template_kwargs or {}))
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"cannot apply the chat template: {exc}") from exc

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    template_kwargs: dict | None = None,
                    max_tokens: int | None = None) -> list[int]:
        """`continue_final_message`: the prompt ends inside the last message, right after its
        text (the template's end-of-turn and anything after it cut off), so the model goes
        on with that message (an assistant's answer begun by the caller)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                tools=tools, template_kwargs=template_kwargs)
        if continue_final_message:
            final = str(messages[-1].get("content") or "").strip()
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ChatTemplateError("continue_final_message: the chat template does not "
                                        "write the last message's text as it is; cannot end the "
                                        "prompt inside it")
            text = text[:at + len(final)]
        # The template writes the special tokens itself; adding them again would double BOS.
        return self.encode(text, add_special_tokens=False, max_tokens=max_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI logprobs' `bytes`)."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = self._compute_token_bytes(token_id)
        return cached

    def is_special(self, token_id: int) -> bool:
        """A special token: what `decode(..., skip_special_tokens=True)` leaves out."""
        return token_id in self._special_ids

    def added_token_text(self, token_id: int) -> str | None:
        """An added token's (special or not) own text; None for the model's other tokens."""
        return self._added_text.get(token_id)

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _compute_token_bytes(self, token_id: int) -> bytes:
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and not _is_added_token(self.backend, token_id):
            return bytes(_UNICODE_TO_BYTE.get(ch, 0) for ch in piece)
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def _special_token_strings(self) -> dict[str, str]:
        out = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = self.config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            out[name] = value or ""
        return out


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent,
                                                                  ensure_ascii=False)
    return env.from_string(source)


def _reads_tools(source: str) -> bool:
    try:
        return "tools" in meta.find_undeclared_variables(
            ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(source))
    except jinja2.TemplateSyntaxError:
        return False


def _uses_byte_level(decoder) -> bool:
    if decoder is None:
        return False
    if isinstance(decoder, decoders.ByteLevel):
        return True
    if isinstance(decoder, decoders.Sequence):
        return "ByteLevel" in repr(decoder)
    return False


def _is_added_token(backend: Tokenizer, token_id: int) -> bool:
    return token_id in backend.get_added_tokens_decoder()


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to 256+."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_UNICODE_TO_BYTE = {ch: b for b, ch in _byte_to_unicode().items()}
