"""Tokenizer and chat template: the `tokenizers` library for text <-> ids, Jinja for the template."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from strata.errors import CheckpointError, StrataError


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        extra_stop_ids: tuple[int, ...] = (),
    ):
        self.backend = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        stops = {i for i in (self.eos_token_id, *extra_stop_ids) if i is not None}
        self.stop_ids: frozenset[int] = frozenset(stops)

    @classmethod
    def from_folder(cls, folder: Path) -> "Tokenizer | None":
        """A Hugging Face folder's tokenizer.json + tokenizer_config.json; None when the folder has no tokenizer."""
        file = folder / "tokenizer.json"
        if not file.exists():
            return None
        try:
            backend = HFTokenizer.from_file(str(file))
        except Exception as e:  # the library raises plain Exceptions for malformed files
            raise CheckpointError(f"{file}: unreadable tokenizer ({e})") from None
        cfg_file = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        template = cfg.get("chat_template")
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        gen_file = folder / "generation_config.json"
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.exists() else None
        extra = tuple(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            extra_stop_ids=extra,
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also when it holds part of a UTF-8 character (which `decode` of the
        token alone turns into U+FFFD): byte-level BPE pieces through GPT-2's byte alphabet, `<0xAB>` byte tokens."""
        text = self.decode([token_id])
        if "\ufffd" not in text:
            return text.encode()
        piece = self.backend.id_to_token(token_id) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        table = _byte_alphabet()
        if piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return text.encode()

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise StrataError("this model has no chat template; send a plain prompt instead of chat messages")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(f"the model's chat template does not parse: {e}") from None

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **extra) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as e:
            raise StrataError(f"the chat template refused the messages: {e}") from None

    def encode_chat(self, messages: list[dict], **extra) -> list[int]:
        # the rendered template carries its own BOS where the model wants one
        return self.encode(self.apply_chat_template(messages, **extra), add_special_tokens=False)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves, the other 68
    bytes for the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _token_text(token) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(token, dict):
        return token.get("content")
    return token
