"""Tokenizers built from GGUF metadata encode a few thousand strings (unicode, whitespace runs, digits, special
tokens) exactly as the Hugging Face tokenizer of the same vocabulary does, for each pre-tokenizer we read.

Vocabularies are trained here with the `tokenizers` library; each is written to a GGUF file the way
convert_hf_to_gguf.py writes one. The references are independent of engine/text/gguf_tokenizer.py: the
tokenizer.json layout each model family publishes (Llama 3, Qwen2, SmolLM, GPT-2, Llama 2), built from
transformers' own regexes and merge recovery, transformers' tokenizer classes, and transformers' GGUF loader.
"""

import json
import random
import unicodedata

import pytest
from tokenizers import Tokenizer, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

gguf = pytest.importorskip("gguf")
from transformers import AutoTokenizer, GPT2Tokenizer, Qwen2Tokenizer  # noqa: E402
from transformers.integrations.gguf.gguf_tokenizer_mapping import _GPT4O_SPLIT, _LLAMA3_SPLIT, _TEKKEN_SPLIT  # noqa: E402,E501
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT  # noqa: E402
from transformers.tokenization_utils_base import generate_merges  # noqa: E402

from stowage.engine.errors import ModelFormatError, UnsupportedModelError  # noqa: E402
from stowage.engine.formats.gguf import GGUFFile  # noqa: E402
from stowage.engine.text.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402

T = gguf.TokenType
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # control tokens
USER = "<tool_call>"  # a user-defined token: matched whole, not special
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "memory", "plan", "context", "Stowage",
         "tokens", "weights", "don't", "I'm", "we'll", "they're", "it's", "HELLO", "Hello", "camelCase", "snake_case",
         "Café", "naïve", "Ünïcödé", "東京", "日本語", "Привет", "мир", "مرحبا", "שלום", "🚀", "😀👍", "ß",
         "e\u0301",
         "x²", "½", "—", "…", "«quote»", "fi", "ǅ", "ﬀ"]
PUNCT = ["!", "?", ".", ",", "...", "?!", "(", ")", "[", "]", "{", "}", '"', "'", "-", "_", "/", "\\", "#", "@",
         "$", "%", "&", "*", "+", "=", "<", ">", "|", "~", "`", ":", ";"]
SPACES = [" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "  \n\n  ", "\u00a0", "\u3000"]


# in the test vocabularies as whole tokens that no merge reaches, and never in the training text
UNSEEN = ["zebraquartz", "Plumbago", "XYZZY"]


def strings(count: int, seed: int, specials=SPECIAL + [USER], words=WORDS + UNSEEN) -> list[str]:
    rng = random.Random(seed)

    def piece() -> str:
        kind = rng.random()
        if kind < 0.5:
            return rng.choice(words)
        if kind < 0.7:
            return str(rng.randint(0, 10 ** rng.randint(1, 12)))
        if kind < 0.85:
            return rng.choice(PUNCT)
        if kind < 0.95:
            return "".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 3)))
        return rng.choice(specials)

    out = []
    for _ in range(count):
        parts = [piece() for _ in range(rng.randint(1, 12))]
        seps = [rng.choice(SPACES) if rng.random() < 0.8 else "" for _ in parts]
        text = "".join(p + s for p, s in zip(parts, seps))
        out.append(text if rng.random() < 0.7 else rng.choice(SPACES) + text)
    return out


CORPUS = strings(2000, seed=1, specials=[""], words=WORDS)
TESTS = strings(3000, seed=2)


def write_tokenizer_gguf(path, **kv):
    w = gguf.GGUFWriter(path, "llama")
    for key, value in kv.items():
        if key == "tokens":
            w.add_token_list(value)
        elif key == "types":
            w.add_token_types(value)
        elif key == "merges":
            w.add_token_merges(value)
        elif key == "scores":
            w.add_token_scores(value)
        elif key == "model":
            w.add_tokenizer_model(value)
        elif key == "pre":
            w.add_tokenizer_pre(value)
        elif key == "bos":
            w.add_bos_token_id(value)
        elif key == "eos":
            w.add_eos_token_id(value)
        elif key == "unk":
            w.add_unk_token_id(value)
        elif key == "add_bos":
            w.add_add_bos_token(value)
        elif key == "template":
            w.add_chat_template(value)
    w.add_tensor("x", __import__("numpy").zeros((1, 32), "float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- byte-level BPE ---------------------------------------------------------------------------------

BYTE_LEVEL = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def split_then_bytes(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


# pre type -> (tokenizer.json pre_tokenizer, normalizer, ignore_merges), as the published files hold them
PUBLISHED = {
    "llama-bpe": (split_then_bytes(_LLAMA3_SPLIT), None, True),  # meta-llama/Llama-3.x
    "qwen2": (split_then_bytes(QWEN2_SPLIT), {"type": "NFC"}, False),  # Qwen/Qwen2.5-*
    "smollm": ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                      {"type": "ByteLevel", **BYTE_LEVEL}]}, None, False),
    "gpt-2": ({"type": "ByteLevel", **BYTE_LEVEL}, None, False),
    "gpt-4o": (split_then_bytes(_GPT4O_SPLIT), None, False),  # openai/gpt-oss-*
    "tekken": (split_then_bytes(_TEKKEN_SPLIT), None, False),  # mistralai/Mistral-Nemo-*
}


def published(pre: str, vocab: dict, merges: list, bos: str | None) -> Tokenizer:
    pre_tokenizer, normalizer, ignore_merges = PUBLISHED[pre]
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": t != USER} for t in SPECIAL + [USER]],
        "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
        "post_processor": None if bos is None else {
            "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [vocab[bos]], "tokens": [bos]}}},
        "decoder": {"type": "ByteLevel", **BYTE_LEVEL},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": [" ".join(m) for m in merges]},
    }
    return Tokenizer.from_str(json.dumps(spec))


WHOLE_WORDS = ["Ġzebraquartz", "zebraquartz", "ĠPlumbago", "XYZZY"]  # byte-level spellings of UNSEEN


@pytest.fixture(scope="module")
def trained():
    """A byte-level BPE vocabulary and merges, trained with GPT-2's split (so it has digit and space merges that
    the other splitters must keep from applying), plus whole words no merge reaches (Llama 3's ignore_merges)."""
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=SPECIAL + [USER], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = dict(spec["model"]["vocab"])
    for word in WHOLE_WORDS:
        assert word not in vocab
        vocab[word] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["model"]["merges"]]
    return vocab, merges


@pytest.fixture(scope="module", params=list(PUBLISHED))
def byte_level(request, trained, tmp_path_factory):
    """(pre type, GGUF path, vocab, merges): the trained vocabulary in a GGUF file that names this pre-tokenizer."""
    pre = request.param
    vocab, merges = trained
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    types = [T.CONTROL if t in SPECIAL else T.USER_DEFINED if t == USER else T.NORMAL for t in tokens]
    path = write_tokenizer_gguf(tmp_path_factory.mktemp(pre) / "tok.gguf", model="gpt2", pre=pre, tokens=tokens,
                                types=types, merges=[" ".join(m) for m in merges], bos=vocab["<|im_start|>"],
                                eos=vocab["<|im_end|>"], add_bos=pre == "llama-bpe", template="{{ messages }}")
    return pre, path, vocab, merges


def read_tokenizer(path):
    return tokenizer_from_gguf(GGUFFile(path).metadata, path.name)


def assert_same_encoding(ours, reference, texts, **kwargs):
    mismatches = [t for t in texts if ours.encode(t) != reference(t, **kwargs)]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, e.g. {mismatches[:3]!r}"


def test_byte_level_matches_the_published_tokenizer_json(byte_level):
    pre, path, vocab, merges = byte_level
    ours = read_tokenizer(path)
    bos = "<|im_start|>" if pre == "llama-bpe" else None
    reference = published(pre, vocab, merges, bos)
    assert_same_encoding(ours, lambda t: reference.encode(t).ids, TESTS)
    ids = reference.encode(TESTS[7]).ids
    assert ours.decode(ids) == reference.decode(ids) and ours.decode(ids, False) == reference.decode(ids, False)
    assert (ours.bos_token, ours.eos_token, ours.chat_template) == ("<|im_start|>", "<|im_end|>", "{{ messages }}")
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [vocab["<|im_end|>"]]  # a control token is whole
    assert ours.encode(USER, add_special_tokens=False) == [vocab[USER]]


def test_byte_level_matches_transformers(byte_level):
    pre, path, vocab, merges = byte_level
    ours = read_tokenizer(path)
    if pre in ("qwen2", "gpt-2"):  # transformers' own classes for these vocabularies
        cls = Qwen2Tokenizer if pre == "qwen2" else GPT2Tokenizer
        reference = cls(vocab=vocab, merges=merges)
        reference.add_special_tokens({"additional_special_tokens": SPECIAL}, replace_extra_special_tokens=False)
        reference.add_tokens([USER])
        assert_same_encoding(ours, lambda t: reference(t, add_special_tokens=False)["input_ids"], TESTS)
    if pre != "smollm":  # transformers' GGUF loader splits by no regex of SmolLM's, so it differs on digits
        loaded = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        # its loader adds no NFC for qwen2 and no ignore_merges for llama-bpe (the published tokenizer.json have
        # both): compare on text NFC leaves alone, without the words only ignore_merges keeps whole
        texts = [t for t in TESTS if unicodedata.normalize("NFC", t) == t and not any(w in t for w in UNSEEN)]
        assert len(texts) > 1500
        assert_same_encoding(ours, lambda t: loaded(t)["input_ids"], texts)


# -- SentencePiece (llama) ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    """(GGUF path, tokens, scores): a SentencePiece-style BPE vocabulary laid out as Llama 2's is."""
    trainer_tok = Tokenizer(BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "▁")
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer_tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=1200, show_progress=False))
    spec = json.loads(trainer_tok.to_str())
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["model"]["merges"]]
    merged = ["".join(m) for m in merges]
    chars = sorted(set(spec["model"]["vocab"]) - set(merged))
    # ids as in Llama 2: <unk> <s> </s>, the 256 byte tokens, then pieces by score: merges best first, chars last
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + merged + chars + [USER]
    scores = [0.0] * 259 + [-float(i) for i in range(len(merged) + len(chars))] + [0.0]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * (len(merged) + len(chars)) + \
        [T.USER_DEFINED]
    path = write_tokenizer_gguf(tmp_path_factory.mktemp("spm") / "tok.gguf", model="llama", tokens=tokens,
                                scores=scores, types=types, bos=1, eos=2, unk=0)
    return path, tokens, scores


def llama2_tokenizer_json(tokens, scores) -> Tokenizer:
    """The layout of Llama 2's published tokenizer.json, merges recovered by transformers from the scores."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = generate_merges(vocab, dict(zip(tokens, scores)))
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": t != USER} for i, t in enumerate(tokens)
                         if t in ("<unk>", "<s>", "</s>", USER)],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                           {"type": "Replace", "pattern": {"String": " "},
                                                            "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                                    {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [" ".join(m) for m in merges]},
    }
    return Tokenizer.from_str(json.dumps(spec))


def test_sentencepiece_matches_llama_2s_tokenizer_json(sentencepiece):
    path, tokens, scores = sentencepiece
    ours = read_tokenizer(path)
    reference = llama2_tokenizer_json(tokens, scores)
    texts = TESTS + [t.replace("<|im_start|>", "<s>").replace("<|im_end|>", "</s>") for t in TESTS[:500]]
    assert_same_encoding(ours, lambda t: reference.encode(t).ids, texts)
    byte_fallback = [t for t in TESTS if any(i < 259 and i > 2 for i in reference.encode(t).ids)]
    assert len(byte_fallback) > 100  # characters outside the vocabulary were spelled in bytes
    for text in TESTS[:200]:
        ids = reference.encode(text).ids
        assert ours.decode(ids) == reference.decode(ids)
    assert ours.encode("hi")[0] == 1 and (ours.bos_token, ours.eos_token) == ("<s>", "</s>")


def test_sentencepiece_matches_transformers_gguf_loader_where_both_prefix_alike(sentencepiece):
    path, _, _ = sentencepiece
    ours = read_tokenizer(path)
    loaded = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # transformers' loader puts the "▁" prefix on the first run of text only (Metaspace "first"); Llama 2's file
    # and llama.cpp put it after special tokens too. Text without them, not starting with a space, is encoded alike.
    texts = [t for t in TESTS if not any(s in t for s in SPECIAL + [USER]) and not t[0].isspace()]
    assert len(texts) > 1000
    assert_same_encoding(ours, lambda t: loaded(t)["input_ids"], texts)


# -- what is refused ----------------------------------------------------------------------------------


def test_an_unknown_pre_tokenizer_or_model_is_refused():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "chameleon", "tokenizer.ggml.tokens": ["a", "b"],
            "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'chameleon'"):
        tokenizer_from_gguf(meta, "m.gguf")
    # a merge whose result is not a token: the tokenizers library panics (a BaseException); a format error here
    with pytest.raises(ModelFormatError, match="do not make a BPE model"):
        tokenizer_from_gguf({**meta, "tokenizer.ggml.pre": "gpt-2"}, "m.gguf")
    with pytest.raises(UnsupportedModelError, match="tokenizer model 'bert'"):
        tokenizer_from_gguf({**meta, "tokenizer.ggml.model": "bert"}, "m.gguf")


def test_inconsistent_metadata_is_a_format_error():
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(ModelFormatError, match="no token list"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2"}, "m.gguf")
    with pytest.raises(ModelFormatError, match="2 token types for 3 tokens"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.token_type": [1, 1]}, "m.gguf")
    with pytest.raises(ModelFormatError, match="bos_token_id is 7, not a token id below 3"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.bos_token_id": 7}, "m.gguf")
    with pytest.raises(ModelFormatError, match="not two tokens separated by a space"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.merges": ["ab"]}, "m.gguf")
    with pytest.raises(ModelFormatError, match="one score per token"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.model": "llama"}, "m.gguf")


def test_an_embedded_tokenizer_json_is_used_as_it_is(trained):
    vocab, merges = trained
    reference = published("gpt-2", vocab, merges, "<|im_start|>")
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": list(vocab), "tokenizer.ggml.merges": [],
            "tokenizer.huggingface.json": reference.to_str()}
    ours = tokenizer_from_gguf(meta, "m.gguf")
    assert ours.encode("the lazy dog 123") == reference.encode("the lazy dog 123").ids
    assert ours.encode("x")[0] == vocab["<|im_start|>"]  # the embedded file's own post-processor
