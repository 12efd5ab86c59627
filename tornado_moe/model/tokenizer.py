"""Tokenizers rebuilt from GGUF metadata: byte-level BPE (``tokenizer.ggml.model == "gpt2"``: Qwen, OLMoE,
SmolLM, Llama 3) and SentencePiece BPE (``"llama"``: Llama 2, Mistral, Mixtral).

Byte-level BPE: the GGUF file carries the vocabulary (byte-level strings, e.g. ``"Ġthe"``), the merges in rank
order, token types and the pre-tokenizer name (``tokenizer.ggml.pre``). We assemble a HuggingFace
``tokenizers.Tokenizer`` from them: the split regex(es) that llama.cpp uses for that ``pre`` value, then the
GPT-2 byte-to-unicode mapping, then BPE. Control (3) and user-defined (4) tokens are added as special tokens
so that ``"<|im_start|>"`` in a prompt becomes one id, as chat templates expect.

SentencePiece BPE: the file carries the pieces (``"▁the"``, ``"<0x0A>"``), their scores and types. Special
tokens are matched whole in the text as above; every other stretch of text has its spaces escaped to ``▁``
(and, as llama.cpp does, one ``▁`` put in front when it starts the text or follows a special token:
``tokenizer.ggml.add_space_prefix``) and is encoded by score-ordered merges (tornado_moe.model.spm).

Decoding goes through :meth:`Tokenizer.token_bytes` (exact bytes of each token) so that the whole-string
decoder and the streaming decoder agree byte for byte; the streaming decoder holds back an incomplete UTF-8
sequence until the token that completes it arrives.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from tornado_moe.errors import InputError, UnsupportedModelError
from tornado_moe.model.spm import ESCAPED_SPACE, SpmEncoder

__all__ = ["Tokenizer", "StreamDecoder", "PRE_TOKENIZER_REGEXES", "CHATML_TEMPLATE", "CHAT_TEMPLATES",
           "IDS_INSTEAD"]

# The advice that ends the errors of an unsupported tokenizer
IDS_INSTEAD = "pass token ids (--prompt-ids) instead"

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ``tokenizer.ggml.pre`` -> regexes applied in sequence (each splits the pieces of the previous one), as
# llama.cpp does; the names it gives one pattern are grouped (llama-vocab.cpp), so files naming any load.
_PRE_GROUPS: dict[tuple[str, ...], tuple[str, ...]] = {
    (_GPT2,): ("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"),
    (_QWEN2,): ("qwen2", "deepseek-r1-qwen"),
    (_LLAMA3,): ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe"),
    # every digit its own piece, then GPT-2 splitting
    (r"\p{N}", _GPT2): ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
}
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    name: regexes for regexes, names in _PRE_GROUPS.items() for name in names
}

# pre-tokenizers whose BPE first looks the whole piece up in the vocabulary (llama.cpp "ignore_merges").
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"})

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Mistral / Mixtral instruct: "<s>[INST] user [/INST]answer</s>[INST] ..."; a system message is put in front
# of the first user message.
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% set sys = namespace(text='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set sys.text = message['content'] + '\n\n' %}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + sys.text + message['content'] + ' [/INST]' }}"
    "{% set sys.text = '' %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
# Llama 2 chat: "<s>[INST] <<SYS>>\nsystem\n<</SYS>>\n\nuser [/INST] answer </s><s>[INST] ..."
_LLAMA2_TEMPLATE = (
    "{% set sys = namespace(text='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set sys.text = '<<SYS>>\n' + message['content'] + '\n<</SYS>>\n\n' %}"
    "{% elif message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + sys.text + message['content'] + ' [/INST]' }}"
    "{% set sys.text = '' %}"
    "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
#: chat templates by name, for files without one (``generate --chat-template NAME``)
CHAT_TEMPLATES: dict[str, str] = {
    "chatml": CHATML_TEMPLATE, "mistral": _MISTRAL_TEMPLATE, "llama2": _LLAMA2_TEMPLATE
}


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in increasing order, to U+0100...
    """
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_UNICODE = _byte_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in _BYTE_TO_UNICODE.items()}


class Tokenizer:
    """Text <-> token ids for a GGUF model; see the module docstring.

    A model without a tokenizer (``tokenizer.ggml.model`` "none" or absent) gives ``has_text == False``;
    then encode/decode raise :class:`InputError` and callers must pass token ids.
    """

    def __init__(
        self,
        *,
        tokens: Sequence[str] | None = None,
        merges: Sequence[str] | None = None,
        token_types: Sequence[int] | None = None,
        pre: str = "default",
        bos_id: int | None = None,
        eos_id: int | None = None,
        eot_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        scores: Sequence[float] | None = None,
        add_space_prefix: bool = True,
    ) -> None:
        self.has_text = tokens is not None
        self.pre = pre
        self.add_space_prefix = add_space_prefix
        self.bos_id = bos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.tokens: list[str] = list(tokens) if tokens is not None else []
        types = list(token_types) if token_types is not None else [TOKEN_TYPE_NORMAL] * len(self.tokens)
        if len(types) != len(self.tokens):
            raise UnsupportedModelError(
                f"tokenizer: {len(self.tokens)} tokens but {len(types)} token types in the metadata"
            )
        self.token_types = types
        # Both kinds are matched atomically in text; only CONTROL tokens are hidden by skip_special.
        self._special = {i for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)}
        self._control = {i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL}
        self.vocab_size = len(self.tokens)

        eos: set[int] = set()
        for i in (eos_id, eot_id):
            if i is not None:
                eos.add(int(i))
        index = {t: i for i, t in enumerate(self.tokens)}
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            if name in index:
                eos.add(index[name])
        self.eos_id = eos_id
        self.eos_ids: frozenset[int] = frozenset(eos)

        self._hf: Any = None
        self._spm: SpmEncoder | None = None  # SentencePiece vocabularies (their pieces come with scores)
        if self.has_text and scores is not None:
            self._spm = self._build_spm(scores)
        elif self.has_text:
            self._hf = self._build_hf(merges or [])

    # ---------------------------------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any] | None, *, text: bool = True) -> Tokenizer:
        """Build from a GGUF metadata dict (``GGUFModel.metadata``); a text-less tokenizer if none.

        ``text=False`` builds the text-less one whatever the file holds (its special token ids kept, so that
        generation from token ids still stops at the end of sequence): for a file whose tokenizer is not
        supported, prompted with token ids.
        """
        md = metadata or {}
        model = md.get("tokenizer.ggml.model")

        def opt_id(key: str) -> int | None:
            v = md.get(key)
            return int(v) if v is not None else None

        common = dict(
            bos_id=opt_id("tokenizer.ggml.bos_token_id"),
            eos_id=opt_id("tokenizer.ggml.eos_token_id"),
            eot_id=opt_id("tokenizer.ggml.eot_token_id"),
            chat_template=md.get("tokenizer.chat_template"),
        )
        if model is None or model == "none" or not text:
            return cls(**common)
        if model == "llama":
            tokens, scores = md.get("tokenizer.ggml.tokens"), md.get("tokenizer.ggml.scores")
            if not tokens or scores is None or len(scores) != len(tokens):
                raise UnsupportedModelError(
                    "tokenizer metadata incomplete: a SentencePiece vocabulary needs 'tokenizer.ggml.tokens' "
                    f"and as many 'tokenizer.ggml.scores'; {IDS_INSTEAD}"
                )
            return cls(
                tokens=tokens,
                token_types=md.get("tokenizer.ggml.token_type"),
                scores=scores,
                add_bos=bool(md.get("tokenizer.ggml.add_bos_token", True)),  # llama.cpp's default for these
                add_space_prefix=bool(md.get("tokenizer.ggml.add_space_prefix", True)),
                **common,
            )
        if model != "gpt2":
            raise UnsupportedModelError(
                f"tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' and SentencePiece "
                f"'llama'); {IDS_INSTEAD}"
            )
        pre = str(md.get("tokenizer.ggml.pre", "default"))
        if pre not in PRE_TOKENIZER_REGEXES:
            raise UnsupportedModelError(
                f"tokenizer pre-tokenizer {pre!r} is not supported (supported: "
                f"{', '.join(sorted(PRE_TOKENIZER_REGEXES))}); {IDS_INSTEAD}"
            )
        tokens = md.get("tokenizer.ggml.tokens")
        merges = md.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise UnsupportedModelError(
                "tokenizer metadata incomplete: 'tokenizer.ggml.tokens' and 'tokenizer.ggml.merges' "
                "are needed"
            )
        return cls(
            tokens=tokens,
            merges=merges,
            token_types=md.get("tokenizer.ggml.token_type"),
            pre=pre,
            add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)),
            **common,
        )

    def _build_hf(self, merges: Sequence[str]) -> Any:
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        vocab: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            vocab.setdefault(t, i)  # duplicated strings: the lowest id wins
        pairs: list[tuple[str, str]] = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise UnsupportedModelError(f"tokenizer: malformed merge {m!r} (expected 'left right')")
            pairs.append((a, b))
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=self.pre in _IGNORE_MERGES, fuse_unk=False)
        tk = HFTokenizer(bpe)
        splits = [
            pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False)
            for rx in PRE_TOKENIZER_REGEXES[self.pre]
        ]
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tk.decoder = decoders.ByteLevel()
        if self._special:
            tk.add_special_tokens(
                [
                    AddedToken(self.tokens[i], special=i in self._control, normalized=False)
                    for i in sorted(self._special)
                ]
            )
        return tk

    def _build_spm(self, scores: Sequence[float]) -> SpmEncoder:
        byte_ids: dict[int, int] = {}
        for i, (t, kind) in enumerate(zip(self.tokens, self.token_types, strict=True)):
            if kind == TOKEN_TYPE_BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                byte_ids.setdefault(int(t[3:5], 16), i)
        self._byte_of = {i: b for b, i in byte_ids.items()}
        unk = next((i for i, kind in enumerate(self.token_types) if kind == TOKEN_TYPE_UNKNOWN), None)
        mergeable = [kind == TOKEN_TYPE_NORMAL for kind in self.token_types]
        if self._special:  # special tokens written in the text: matched whole, longest first
            texts = sorted({self.tokens[i] for i in self._special}, key=len, reverse=True)
            self._special_re = re.compile("|".join(map(re.escape, texts)))
            self._special_id: dict[str, int] = {}
            for i in sorted(self._special):
                self._special_id.setdefault(self.tokens[i], i)
        return SpmEncoder(self.tokens, scores, mergeable, byte_ids, unk)

    def _encode_spm(self, text: str) -> list[int]:
        """llama.cpp's SentencePiece path: special tokens whole, the stretches between them encoded, each with
        a space in front where it starts the text or follows a special token (add_space_prefix)."""
        assert self._spm is not None
        pieces: list[tuple[str, int | None]] = []  # (text, None) or (special text, its id)
        pos = 0
        if self._special:
            for m in self._special_re.finditer(text):
                if m.start() > pos:
                    pieces.append((text[pos:m.start()], None))
                pieces.append((m.group(), self._special_id[m.group()]))
                pos = m.end()
        if pos < len(text):
            pieces.append((text[pos:], None))
        ids: list[int] = []
        after_special = True
        for chunk, special_id in pieces:
            if special_id is not None:
                ids.append(special_id)
                after_special = True
                continue
            if self.add_space_prefix and after_special:
                chunk = " " + chunk
            ids += self._spm.encode(chunk.replace(" ", ESCAPED_SPACE))
            after_special = False
        return ids

    def _need_text(self) -> None:
        if not self.has_text:
            raise InputError("this model carries no tokenizer; pass token ids (--prompt-ids)")

    # ---------------------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; control tokens written literally (``<|im_start|>``) become their id.

        ``add_bos`` None follows the file (``tokenizer.ggml.add_bos_token``).
        """
        self._need_text()
        if not isinstance(text, str):
            raise InputError(f"encode: expected str, got {type(text).__name__}")
        if self._spm is not None:
            ids = self._encode_spm(text)
        else:
            ids = self._hf.encode(text, add_special_tokens=False).ids
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos:
            if self.bos_id is None:
                raise InputError("encode: add_bos requested but the model defines no BOS token")
            if ids[:1] != [self.bos_id]:  # not twice where the text (a chat template) starts with it
                ids = [self.bos_id, *ids]
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token ``token_id`` stands for (special tokens: their UTF-8 text)."""
        self._need_text()
        if not 0 <= token_id < self.vocab_size:
            raise InputError(f"token id {token_id} is out of range 0..{self.vocab_size - 1}")
        tok = self.tokens[token_id]
        if token_id in self._special:
            return tok.encode("utf-8")
        if self._spm is not None:
            byte = self._byte_of.get(token_id)
            return bytes([byte]) if byte is not None else tok.replace(ESCAPED_SPACE, " ").encode("utf-8")
        try:
            return bytes(_UNICODE_TO_BYTE[c] for c in tok)
        except KeyError:
            # Not a byte-level string (rare hand-added tokens): take its text as is.
            return tok.encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        """True for control / user-defined tokens (matched whole in text, decoded as their text)."""
        return token_id in self._special

    def is_control(self, token_id: int) -> bool:
        """True for control tokens (``<|im_start|>``...): the ones ``skip_special`` hides."""
        return token_id in self._control

    @property
    def hf(self) -> Any:
        """The underlying ``tokenizers.Tokenizer`` (None without one: no tokenizer, or SentencePiece)."""
        return self._hf

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (e.g. a cut multi-byte character) decodes to U+FFFD."""
        self._need_text()
        data = b"".join(
            self.token_bytes(int(i)) for i in ids if not (skip_special and int(i) in self._control)
        )
        return data.decode("utf-8", errors="replace")

    def stream(self, *, skip_special: bool = False) -> StreamDecoder:
        """A fresh streaming decoder (see :class:`StreamDecoder`)."""
        self._need_text()
        return StreamDecoder(self, skip_special=skip_special)

    def decode_stream(self, ids: Iterable[int], *, skip_special: bool = False) -> Iterator[str]:
        """Yield text pieces as ids arrive; the concatenation equals ``decode(ids)``."""
        dec = self.stream(skip_special=skip_special)
        for i in ids:
            piece = dec.push(i)
            if piece:
                yield piece
        tail = dec.flush()
        if tail:
            yield tail

    # ---------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's Jinja chat template.

        Falls back to ChatML when the file has no template. Rendering is sandboxed.
        """
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise InputError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        source = self.chat_template or CHATML_TEMPLATE
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InputError(f"chat message must be a dict with 'role' and 'content', got {m!r}")

        def tok_text(i: int | None) -> str:
            return self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else ""

        try:
            return env.from_string(source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=tok_text(self.bos_id),
                eos_token=tok_text(self.eos_id),
            )
        except TemplateError as e:
            raise InputError(f"chat template failed to render: {e}") from e

    def __repr__(self) -> str:
        if not self.has_text:
            return "Tokenizer(none)"
        eos = sorted(self.eos_ids)
        kind = "spm" if self._spm is not None else f"gpt2/{self.pre}"
        return f"Tokenizer({kind}, vocab {self.vocab_size}, bos {self.bos_id}, eos {eos})"


class StreamDecoder:
    """Incremental decoder: ``push(id)`` returns the newly complete text (possibly ""), ``flush()`` the rest.

    Bytes of a multi-byte UTF-8 character split across tokens are held until complete, so no piece ever
    contains a half character; the concatenated pieces equal ``Tokenizer.decode`` of all ids.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if self._skip and self._tok.is_control(token_id):
            return ""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """Text of any pending incomplete sequence (as U+FFFD) and reset."""
        return self._utf8.decode(b"", final=True)
