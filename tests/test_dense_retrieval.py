"""Dense retrieval (``drmas.tasks.search.dense``), as the reference's search agent retrieves:
the nearest passages by a plain computation of the same mean-pooled, normalised vectors,
served and in-process searches alike, the index cached under the encoder's identity (reused,
missed by other weights, rebuilt when damaged, never unpickled), a service with another
method or encoder refused, and settings checked where they are given.

The encoders are tiny BERTs built here from a config with random weights (safetensors, a
WordPiece tokenizer over the corpus's words) and loaded from their folders by the real
loading code; the hub is never asked (HF_HUB_OFFLINE=1 in the suite).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import running, write_corpus
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

from drmas.config import ConfigError, load_config
from drmas.infra.store import Store
from drmas.tasks.search.client import RetrievalClient, RetrievalMismatch
from drmas.tasks.search.dense import QUERY_BATCH, DenseEncoding, DenseRetriever, Encoder, EncoderError
from drmas.tasks.search.retrieval import Retriever, cached_retriever
from drmas.tasks.search.service import main, serve
from drmas.tasks.search.task import SearchTask, retrieval_client
from drmas.tasks.search.world import generate_fact_world
from drmas.team.orchestras import Passage

ROOT = Path(__file__).resolve().parents[1]
SEED = 3
MAX_LENGTH = 11
"""Tokens read per text: a generated fact with its prefix, [CLS] and [SEP] is 11."""
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def build_encoder(folder: Path, words: set[str], seed: int) -> Path:
    """A BERT of two layers, 32 wide, with random weights drawn from ``seed`` and a lower-
    casing WordPiece tokenizer knowing ``words``, saved in the Hugging Face layout."""
    vocab = {token: i for i, token in enumerate([*SPECIALS, *sorted(words)])}
    raw = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    raw.normalizer = normalizers.BertNormalizer(lowercase=True)
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    )
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def passages() -> list[Passage]:
    return generate_fact_world(SEED, entities=30)[0]


@pytest.fixture(scope="module")
def folders(passages: list[Passage], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two encoders that differ only in their weights, and a copy of the first elsewhere."""
    words = {word.lower() for p in passages for word in re.findall(r"\w+", p.text)} | {"query", "passage", ":"}
    root = tmp_path_factory.mktemp("encoders")
    first = build_encoder(root / "first", words, seed=0)
    other = build_encoder(root / "other", words, seed=1)
    copy = Path(shutil.copytree(first, root / "copy"))
    return {"first": first, "other": other, "copy": copy}


@pytest.fixture(scope="module")
def encoder(folders: dict[str, Path]) -> Encoder:
    return DenseEncoding(str(folders["first"]), max_length=MAX_LENGTH, batch_size=8).load()


@pytest.fixture(scope="module")
def corpus_file(passages: list[Passage], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", passages)


def dense_config(tmp_path: Path, folder: Path, corpus_file: Path, *overrides: str):
    return load_config(
        ROOT / "configs" / "search_tiny.yaml",
        [
            f"experiment.seed={SEED}",
            f"store.root={tmp_path / 'runs'}",
            f"data.corpus={corpus_file}",
            "task.retrieval_method=dense",
            f"task.retrieval_encoder={folder}",
            f"task.retrieval_max_length={MAX_LENGTH}",
            *overrides,
        ],
    )


# --------------------------------------------------------------------------------------
# What a dense search finds
# --------------------------------------------------------------------------------------


def plain_vector(encoder: Encoder, text: str) -> np.ndarray:
    """e5's vector of one text, by hand: its tokens cut to MAX_LENGTH (the last kept one
    [SEP]), one unpadded forward pass, the mean of its hidden states, divided by its norm."""
    ids = encoder.tokenizer(text)["input_ids"]
    if len(ids) > MAX_LENGTH:
        ids = [*ids[: MAX_LENGTH - 1], ids[-1]]
    with torch.no_grad():
        hidden = encoder.model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()  # L x H
    mean = hidden.astype(np.float64).mean(axis=0)
    return mean / np.linalg.norm(mean)


def test_a_dense_search_finds_the_nearest_passages_by_a_plain_computation(encoder, passages):
    """The index holds each passage's "passage: " vector, and a query's k results are the
    k passages whose vectors have the largest inner product with its "query: " vector, best
    first, as a brute-force numpy computation over vectors computed one text at a time finds.
    Short and long passages share batches (padding, which the mask keeps out of the mean)
    and a long one is cut."""
    extra = [
        Passage("short", "Fogaros."),
        Passage("long", "The capital of Quertusland is Fogaros, a town founded by Vusstalen Tunkun long ago."),
    ]
    corpus = [*extra, *passages]
    retriever = DenseRetriever.build(corpus, encoder)
    plain = np.stack([plain_vector(encoder, f"passage: {p.text}") for p in corpus])  # N x H
    lengths = [len(encoder.tokenizer(f"passage: {p.text}")["input_ids"]) for p in corpus]
    assert lengths[0] < MAX_LENGTH < lengths[1] and set(lengths[2:]) == {MAX_LENGTH}
    stored = retriever.index.reconstruct_n(0, len(corpus))
    np.testing.assert_allclose(stored, plain, atol=2e-5)
    queries = ["capital of Quertusland", "founded by", "born in 1834", passages[7].text, "Fogaros"]
    for query, found in zip(queries, retriever.search(queries, k=4), strict=True):
        scores = plain @ plain_vector(encoder, f"query: {query}")  # N
        best = np.sort(scores)[::-1][:4]
        got = scores[[corpus.index(p) for p in found]]
        np.testing.assert_allclose(got, best, atol=2e-5)  # the nearest four, best first
        if best[0] - best[1] > 1e-4:
            assert found[0] == corpus[int(np.argmax(scores))]
    # Nothing asked, nothing found; k is clamped to the corpus; k < 1 is a mistake.
    assert retriever.search(["", "  "], k=3) == [[], []]
    assert len(retriever.search(["capital"], k=1000)[0]) == len(corpus)
    with pytest.raises(ValueError, match="k must be at least 1"):
        retriever.search(["capital"], k=0)


def test_the_encoder_reads_safetensors_only_and_names_itself_when_it_fails(folders, tmp_path):
    pickled = Path(shutil.copytree(folders["first"], tmp_path / "pickled"))
    weights = BertModel.from_pretrained(pickled, use_safetensors=True).state_dict()
    (pickled / "model.safetensors").unlink()
    torch.save(weights, pickled / "pytorch_model.bin")
    with pytest.raises(EncoderError, match=f"task.retrieval_encoder '{re.escape(str(pickled))}'"):
        DenseEncoding(str(pickled)).load()
    with pytest.raises(EncoderError, match="missing'?: not a loadable encoder"):
        DenseEncoding(str(tmp_path / "missing")).load()
    # A model whose file lacks an encoder layer would be drawn at random on every load.
    partial = Path(shutil.copytree(folders["first"], tmp_path / "partial"))
    kept = {k: v for k, v in load_file(partial / "model.safetensors").items() if ".layer.1." not in k}
    save_file(kept, partial / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(EncoderError, match="its weights lack .*layer.1"):
        DenseEncoding(str(partial)).load()


# --------------------------------------------------------------------------------------
# Served and in process
# --------------------------------------------------------------------------------------


def test_served_and_in_process_dense_searches_agree(encoder, folders, passages, corpus_file, tmp_path):
    """A real service on a free port and the in-process retriever a run would build return
    the same passages in the same order, over more queries than one request holds; the
    service reports its method and encoder, and the run's client accepts it."""
    queries = [p.text.split(" is ")[0] for p in passages[:90]] + ["", "born in 1700", "capital"]
    assert len(queries) > QUERY_BATCH == RetrievalClient("http://127.0.0.1:9").batch_size
    config = dense_config(tmp_path, folders["first"], corpus_file)
    in_process = SearchTask().tools(config, Store(str(tmp_path / "run-store"))).retriever
    assert isinstance(in_process, DenseRetriever)
    with running(serve(passages, Store(str(tmp_path / "service-store")), "127.0.0.1", 0, encoder)) as server:
        health = RetrievalClient(server.url).health()
        assert health["method"] == "dense" and health["format"] == "drmas.dense/1"
        assert health["settings"] == {
            "encoder": str(folders["first"]),
            "fingerprint": encoder.fingerprint,
            "max_length": MAX_LENGTH,
            "query_prefix": "query: ",
            "passage_prefix": "passage: ",
        }
        assert health["corpus_hash"] == DenseRetriever.corpus_hash(passages, encoder)
        served_config = dense_config(tmp_path, folders["first"], corpus_file, f"task.retrieval_url={server.url}")
        served = retrieval_client(served_config).search(queries, 3)
    expected = in_process.search(queries, 3)
    assert [[p.pid for p in found] for found in served] == [[p.pid for p in found] for found in expected]
    assert served == expected and all(served[:90]) and served[90] == []


def test_the_command_builds_the_dense_index_the_run_names(encoder, folders, passages, corpus_file, tmp_path, capsys):
    """``--build-only --method dense``: the index Job's command caches the index under
    _cache/dense and prints the hash a run computes from its config."""
    store = tmp_path / "store"
    flags = ["--method", "dense", "--encoder", str(folders["first"]), "--max-length", str(MAX_LENGTH)]
    assert main(["--corpus", str(corpus_file), "--store", str(store), "--build-only", *flags]) == 0
    corpus_hash = DenseRetriever.corpus_hash(passages, encoder)
    assert f"corpus hash {corpus_hash}" in capsys.readouterr().out
    assert Store(str(store)).list("_cache/dense") == [f"_cache/dense/{corpus_hash}"]
    assert corpus_hash != Retriever.corpus_hash(passages)
    # A flag the method does not read is refused, naming it.
    assert main(["--corpus", str(corpus_file), "--store", str(store), "--build-only", "--encoder", "x"]) == 1
    assert "--encoder: not read by --method bm25" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------


@pytest.fixture
def encoded(monkeypatch) -> list[int]:
    """Encoder.embed, counting the passages it encodes (queries aside)."""
    counts: list[int] = []
    original = Encoder.embed

    def counting(self, texts, prefix, progress=None):
        if prefix == self.encoding.passage_prefix:
            counts.append(len(texts))
        return original(self, texts, prefix, progress)

    monkeypatch.setattr(Encoder, "embed", counting)
    return counts


def test_the_cache_is_reused_only_for_the_same_weights(encoder, folders, passages, tmp_path, encoded):
    """The second build loads (encodes nothing), a copy of the encoder elsewhere hits the
    same entry, and other weights of the same shape, or another prefix, miss it."""
    store = Store(str(tmp_path / "store"))
    first = cached_retriever(passages, store, encoder)
    assert encoded == [len(passages)]
    again = cached_retriever(list(passages), store, encoder)
    assert encoded == [len(passages)], "the second call encoded the corpus instead of loading it"
    assert again.search(["capital of Quertusland"], 3) == first.search(["capital of Quertusland"], 3)
    copy = DenseEncoding(str(folders["copy"]), max_length=MAX_LENGTH).load()
    assert copy.fingerprint == encoder.fingerprint
    cached_retriever(passages, store, copy)
    assert encoded == [len(passages)], "the same weights in another folder missed the cache"
    other = DenseEncoding(str(folders["other"]), max_length=MAX_LENGTH).load()
    assert other.fingerprint != encoder.fingerprint
    cached_retriever(passages, store, other)
    unprefixed = DenseEncoding(str(folders["first"]), max_length=MAX_LENGTH, passage_prefix="").load()
    cached_retriever(passages, store, unprefixed)
    assert encoded == [len(passages)] * 3
    assert len(store.list("_cache/dense")) == 3
    meta = store.open(f"_cache/dense/{DenseRetriever.corpus_hash(passages, other)}").meta
    assert (meta["encoder"], meta["fingerprint"], meta["passages"]) == (str(folders["other"]), other.fingerprint, 180)


class Unpickled:
    """Unpickling it creates ``marker``: the proof that a load ran a pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("damage", ["modified", "wrong shape", "pickle"])
def test_a_damaged_dense_cache_is_rebuilt_with_a_warning(encoder, passages, tmp_path, encoded, caplog, damage):
    """A file changed behind the manifest's back, an array that is not one vector per
    passage, or a pickled array (never unpickled): each is rebuilt, with a warning naming
    the file, and the rebuilt cache is whole again."""
    store = Store(str(tmp_path / "store"))
    path = f"_cache/dense/{DenseRetriever.corpus_hash(passages, encoder)}"
    marker = tmp_path / "unpickled"
    if damage == "modified":
        cached_retriever(passages, store, encoder)
        (Path(store.root) / path / "index" / "embeddings.npy").write_bytes(b"\x93NUMPY garbage")
    else:
        bad = tmp_path / "bad.npy"
        if damage == "wrong shape":
            np.save(bad, np.zeros((3, encoder.dimension), dtype=np.float32))
        else:
            np.save(bad, np.array([Unpickled(marker)], dtype=object), allow_pickle=True)
        with store.writer(path) as writer:
            writer.write_bytes(
                "passages.jsonl", b"".join(json.dumps({"id": p.pid, "text": p.text}).encode() + b"\n" for p in passages)
            )
            writer.put_file(bad, "index/embeddings.npy")
    encoded.clear()
    with caplog.at_level(logging.WARNING, logger="drmas.tasks.search.retrieval"):
        rebuilt = cached_retriever(passages, store, encoder)
    assert encoded == [len(passages)]
    assert "rebuilding the dense cache" in caplog.text and "embeddings.npy" in caplog.text
    assert not marker.exists(), "a pickle in the cache was run"
    assert rebuilt.search(["capital"], 2) == DenseRetriever.build(passages, encoder).search(["capital"], 2)
    encoded.clear()
    cached_retriever(passages, store, encoder)
    assert encoded == []


# --------------------------------------------------------------------------------------
# A service or a config that does not match
# --------------------------------------------------------------------------------------


def test_the_client_refuses_a_service_with_another_method_or_encoder(encoder, folders, passages, corpus_file, tmp_path):
    """A dense service is refused by a BM25 config and by a dense config of other weights,
    and a BM25 service by a dense config; each message names both sides."""
    with running(serve(passages, Store(str(tmp_path / "dense-store")), "127.0.0.1", 0, encoder)) as server:
        url = f"task.retrieval_url={server.url}"
        bm25 = load_config(
            ROOT / "configs" / "search_tiny.yaml", [f"store.root={tmp_path}", f"data.corpus={corpus_file}", url]
        )
        with pytest.raises(RetrievalMismatch) as raised:
            retrieval_client(bm25).search(["capital"], 3)
        message = str(raised.value)
        assert "serves dense retrieval" in message and "task.retrieval_method is bm25" in message
        assert str(folders["first"]) in message and "--method bm25" in message
        other = dense_config(tmp_path, folders["other"], corpus_file, url)
        with pytest.raises(RetrievalMismatch) as raised:
            retrieval_client(other).search(["capital"], 3)
        message = str(raised.value)
        assert DenseRetriever.corpus_hash(passages, encoder) in message and encoder.fingerprint in message
        assert str(folders["other"]) in message and "task.retrieval_encoder" in message
    with running(serve(passages, Store(str(tmp_path / "bm25-store")), "127.0.0.1", 0)) as server:
        dense = dense_config(tmp_path, folders["first"], corpus_file, f"task.retrieval_url={server.url}")
        with pytest.raises(RetrievalMismatch, match="serves bm25 retrieval .* task.retrieval_method is dense"):
            retrieval_client(dense).search(["capital"], 3)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["task.retrieval_method=colbert"], "task.retrieval_method"),
        (["task.retrieval_method=dense", "task.retrieval_max_length=4"], "task.retrieval_max_length"),
        (["task.retrieval_method=dense", "task.retrieval_batch_size=0"], "task.retrieval_batch_size"),
        (["task.retrieval_method=dense", "task.retrieval_encoder="], "task.retrieval_encoder"),
        (["task.retrieval_encoder=/models/e5"], "retrieval_encoder: only dense retrieval reads it"),
        (["task.retrieval_method=dense", "task.retrieval_stemmer=english"], "retrieval_stemmer: only bm25"),
    ],
)
def test_a_retrieval_setting_is_checked_naming_its_field(overrides, named):
    with pytest.raises(ConfigError) as raised:
        load_config(ROOT / "configs" / "search_tiny.yaml", overrides)
    assert named in str(raised.value)


def test_the_default_config_keeps_bm25_and_its_hashes(passages, tmp_path):
    """A config that says nothing of the method retrieves with BM25 as before, under the
    hash it had before (a plain sha256 of "drmas.bm25/1" and the passages): caches and
    pinned hashes stay valid, and no encoder is loaded."""
    config = load_config(ROOT / "configs" / "search_tiny.yaml", [f"store.root={tmp_path}"])
    assert config.task.retrieval_method == "bm25"
    assert DenseEncoding.of(config.task) == DenseEncoding()  # the service's defaults are the config's
    retriever = SearchTask().tools(config, Store(str(tmp_path / "store"))).retriever
    assert isinstance(retriever, Retriever)
    digest = hashlib.sha256(b"drmas.bm25/1")
    for passage in passages:
        digest.update((json.dumps([passage.pid, passage.text]) + "\n").encode())
    assert Retriever.corpus_hash(passages) == digest.hexdigest()
