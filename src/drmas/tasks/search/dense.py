"""Dense retrieval, as the reference searches: an e5-style encoder and a FAISS flat index.

The reference's search agent retrieves with ``intfloat/e5-base-v2`` and an exact FAISS
index over wiki-18 (Search-R1's retrieval server). drmas does the same, in process or in
the retrieval service (``task.retrieval_method: dense``):

1. A text becomes a vector as e5 makes one: its prefix (``query: `` or ``passage: ``), at
   most ``max_length`` tokens of it, the encoder's last hidden states averaged over the
   attention mask (mean pooling), L2-normalised. The encoder is a transformers ``AutoModel``
   and ``AutoTokenizer`` (a hub id or a folder), its weights read from safetensors only and
   in float32.
2. The passages' vectors fill a ``faiss.IndexFlatIP``: exact inner products, which for
   normalised vectors are cosine similarities. A query gets the ``k`` best, best first; an
   empty query gets none (as in BM25: nothing was asked).
3. The index is cached in the artifact store under ``_cache/dense/{corpus_hash}``: the
   passages and a float32 ``embeddings.npy``, read back with ``allow_pickle=False`` (never a
   pickle, nor a FAISS file whose parser a changed store would feed). A cache that cannot be
   read is rebuilt with a warning (``drmas.tasks.search.retrieval.cached_retriever``).

The corpus hash holds the encoder's identity: a sha256 of its weights and vocabulary, with
the prefixes and the length. An index built with other weights is thus never reused, nor
accepted from a retrieval service, and a folder that holds a copy of a hub model agrees
with its hub id.

Differences from the reference's server: the encoder computes in float32 on a CPU (the
reference uses float16 on a GPU), and a passage is encoded as drmas reads it from the
corpus (``(Title: T) text``; the reference's ``"T"\\ntext``).

torch, transformers and faiss are imported by the functions that use them: a BM25 search
(and the BM25 retrieval service) never loads them.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from drmas.config import PolicyError
from drmas.infra.progress import Progress
from drmas.infra.store import Artifact, ArtifactWriter, CorruptArtifact
from drmas.tasks.search.retrieval import INDEX_DIR, corpus_hash, read_passages, write_passages
from drmas.team.orchestras import Passage

if TYPE_CHECKING:
    import faiss
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from drmas.config import TaskConfig

__all__ = [
    "DENSE_CACHE_PREFIX",
    "DENSE_FORMAT",
    "EMBEDDINGS_FILE",
    "QUERY_BATCH",
    "DenseEncoding",
    "DenseRetriever",
    "Encoder",
    "EncoderError",
]

DENSE_FORMAT = "drmas.dense/1"
"""Part of the corpus hash: a change of pooling, normalisation or layout must miss old caches."""
DENSE_CACHE_PREFIX = "_cache/dense"
EMBEDDINGS_FILE = "embeddings.npy"
QUERY_BATCH = 64
"""Queries encoded and searched at once: the retrieval client's requests hold as many
(``client.QUERIES_PER_REQUEST``), so a served search encodes the batches an in-process one does."""
LOAD_CHUNK = 65536
"""Cached vectors moved into the FAISS index at a time: the file is mapped, never read whole
beside the index (wiki-18's 21M x 768 float32 vectors are 64 GB)."""


class EncoderError(ValueError):
    """The encoder cannot be loaded, or would not compute the same vectors on every load."""


@dataclass(frozen=True)
class DenseEncoding:
    """The config's dense retrieval settings (``task.retrieval_*``), before the encoder is
    loaded: its hub id or folder, the most tokens it reads, the two prefixes, and how many
    passages it encodes at once while building an index."""

    encoder: str = "intfloat/e5-base-v2"
    max_length: int = 256
    query_prefix: str = "query: "
    passage_prefix: str = "passage: "
    batch_size: int = 64

    @classmethod
    def of(cls, task: TaskConfig) -> DenseEncoding:
        return cls(
            task.retrieval_encoder,
            task.retrieval_max_length,
            task.retrieval_query_prefix,
            task.retrieval_passage_prefix,
            task.retrieval_batch_size,
        )

    def describe(self) -> dict[str, Any]:
        """What identifies an index besides the encoder's weights (the batch size does not)."""
        return {
            "encoder": self.encoder,
            "max_length": self.max_length,
            "query_prefix": self.query_prefix,
            "passage_prefix": self.passage_prefix,
        }

    def load(self, device: str = "cpu") -> Encoder:
        """The encoder (a hub id: through the Hugging Face cache, downloaded when missing and
        the hub is reachable), in float32 on ``device``; EncoderError naming it if it cannot
        be loaded, holds pickled weights only, or leaves weights the encoding uses at random."""
        from drmas.models import load_encoder  # noqa: PLC0415 (only dense retrieval loads torch and transformers)

        where = f"task.retrieval_encoder {self.encoder!r}"
        try:
            tokenizer, model, missing_keys = load_encoder(self.encoder)
        except (PolicyError, OSError, ValueError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise EncoderError(f"{where}: not a loadable encoder ({reason})") from None
        # A pooler head is unused by mean pooling; any other missing weight would be drawn at
        # random on each load, and the index would mean nothing.
        missing = sorted(key for key in missing_keys if "pooler" not in key)
        if missing:
            raise EncoderError(
                f"{where}: its weights lack {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            )
        model.eval()
        model.to(device)
        skipped = set(missing_keys)
        return Encoder(self, model, tokenizer, _fingerprint(model, tokenizer, skipped), device)


def _fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, skipped: set[str]) -> str:
    """sha256 of every weight the file gave (name, shape, float32 bytes) and of the
    vocabulary: what makes two encoders compute the same vectors, whatever they are called.
    Files are not hashed: a config or tokenizer file's layout changes with the library
    version that wrote it (the GPU image's transformers is older than the CPU image's),
    the weights and the vocabulary do not."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if name in skipped:
            continue
        digest.update(json.dumps([name, list(tensor.shape)]).encode())
        digest.update(np.ascontiguousarray(tensor.detach().to("cpu").numpy()).data)  # its buffer, not a copy
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    return digest.hexdigest()


class Encoder:
    """A loaded encoder: texts to mean-pooled, L2-normalised float32 vectors, and the
    ``IndexMethod`` of dense retrieval (it builds and loads ``DenseRetriever``s).

    One text is encoded at a time across threads (a fast tokenizer is not reentrant; the
    retrieval service answers requests on many threads), each batch with all the threads
    torch has.
    """

    name: ClassVar[str] = "dense"
    label: ClassVar[str] = "dense"
    format: ClassVar[str] = DENSE_FORMAT
    cache_prefix: ClassVar[str] = DENSE_CACHE_PREFIX

    def __init__(
        self,
        encoding: DenseEncoding,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        fingerprint: str,
        device: str = "cpu",
    ) -> None:
        self.encoding = encoding
        self.model = model
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.device = device
        self.dimension = int(model.config.hidden_size)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Encoder({self.encoding.encoder!r}, fingerprint {self.fingerprint[:12]})"

    def hashed(self) -> bytes:
        settings = self.encoding.describe()
        del settings["encoder"]  # the weights say which encoder it is, not its name
        return json.dumps([self.fingerprint, settings], sort_keys=True, ensure_ascii=False).encode()

    def describe(self) -> dict[str, Any]:
        return {**self.encoding.describe(), "fingerprint": self.fingerprint}

    def build(self, passages: list[Passage]) -> DenseRetriever:
        return DenseRetriever.build(passages, self)

    def load(self, artifact: Artifact) -> DenseRetriever:
        return DenseRetriever.load_from(artifact, self)

    def embed(self, texts: list[str], prefix: str, progress: Progress | None = None) -> np.ndarray:
        """(len(texts), dimension) float32 vectors of ``prefix + text``, in batches of
        ``batch_size`` texts of similar length (less padding; the order is restored)."""
        import torch  # noqa: PLC0415 (see the module's docstring)

        vectors = np.empty((len(texts), self.dimension), dtype=np.float32)  # N x H
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
        size = self.encoding.batch_size
        with self._lock, torch.inference_mode():
            for start in range(0, len(order), size):
                rows = order[start : start + size]
                vectors[rows] = self._batch([prefix + texts[i] for i in rows])
                if progress is not None:
                    progress.update(len(rows))
        return vectors

    def _batch(self, texts: list[str]) -> np.ndarray:
        import torch  # noqa: PLC0415 (see the module's docstring)

        inputs = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.encoding.max_length, return_tensors="pt"
        ).to(self.device)
        hidden = self.model(**inputs).last_hidden_state  # B x L x H
        mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # B x L x 1
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # B x H
        normalised: torch.Tensor = torch.nn.functional.normalize(pooled, p=2.0, dim=-1)
        return normalised.to("cpu").numpy()


class DenseRetriever:
    """Exact inner-product search (FAISS ``IndexFlatIP``) over the passages' vectors."""

    def __init__(self, index: faiss.IndexFlatIP, passages: list[Passage], encoder: Encoder) -> None:
        if index.ntotal != len(passages):
            raise ValueError(f"the index holds {index.ntotal} vectors for {len(passages)} passages")
        self.index = index
        self.passages = passages
        self.encoder = encoder

    @property
    def method(self) -> Encoder:
        return self.encoder

    @classmethod
    def build(cls, passages: list[Passage], encoder: Encoder) -> DenseRetriever:
        """Encode every passage (a progress bar or lines: a wiki-scale corpus takes hours)
        into a new index, a batch at a time (the vectors are held once, in the index)."""
        if not passages:
            raise ValueError("cannot build a retriever over an empty corpus")
        index = _flat_index(encoder.dimension)
        chunk = max(encoder.encoding.batch_size, LOAD_CHUNK)
        texts = [passage.text for passage in passages]
        prefix = encoder.encoding.passage_prefix
        with Progress(len(passages), f"dense index ({encoder.encoding.encoder})", unit="passage") as progress:
            for start in range(0, len(texts), chunk):
                index.add(encoder.embed(texts[start : start + chunk], prefix, progress))
        return cls(index, passages, encoder)

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """The best ``k`` passages for each query, best first, ``QUERY_BATCH`` queries at a
        time. An empty or blank query gets []; ``k`` beyond the corpus size is clamped to it."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        results: list[list[Passage]] = [[] for _ in queries]
        k = min(k, len(self.passages))
        prefix = self.encoder.encoding.query_prefix
        for start in range(0, len(queries), QUERY_BATCH):
            asked = [i for i in range(start, min(start + QUERY_BATCH, len(queries))) if queries[i].strip()]
            if not asked:
                continue
            _, found = self.index.search(self.encoder.embed([queries[i] for i in asked], prefix), k)  # Q x k
            for position, row in zip(asked, found.tolist(), strict=True):
                results[position] = [self.passages[i] for i in row if i >= 0]
        return results

    @staticmethod
    def corpus_hash(passages: Iterable[Passage], encoder: Encoder) -> str:
        """``corpus_hash`` of the passages encoded by ``encoder``."""
        return corpus_hash(passages, encoder)

    def save_to(self, writer: ArtifactWriter) -> None:
        """The passages and their vectors, one float32 .npy (written from the index's own
        memory, through a temporary file: never a second copy in memory)."""
        import faiss  # noqa: PLC0415 (see the module's docstring)

        write_passages(writer, self.passages)
        rows, width = self.index.ntotal, self.index.d
        vectors = faiss.rev_swig_ptr(self.index.get_xb(), rows * width).reshape(rows, width)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / EMBEDDINGS_FILE
            np.save(path, vectors, allow_pickle=False)
            writer.put_file(path, f"{INDEX_DIR}/{EMBEDDINGS_FILE}")

    @classmethod
    def load_from(cls, artifact: Artifact, encoder: Encoder) -> DenseRetriever:
        """A retriever saved by ``save_to`` with this encoder (the cache path's hash says
        so); CorruptArtifact if its files do not make one."""
        passages = read_passages(artifact)
        location = artifact.store.uri(artifact.path, f"{INDEX_DIR}/{EMBEDDINGS_FILE}")
        index = _flat_index(encoder.dimension)
        with tempfile.TemporaryDirectory() as folder:
            artifact.download(folder, prefix=INDEX_DIR)
            try:
                vectors = np.load(Path(folder) / EMBEDDINGS_FILE, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError, EOFError) as error:
                raise CorruptArtifact(f"{location}: not a readable array ({error})") from None
            expected = (len(passages), encoder.dimension)
            if vectors.dtype != np.float32 or vectors.shape != expected:
                raise CorruptArtifact(
                    f"{location}: {vectors.dtype} {vectors.shape}, expected float32 {expected} "
                    "(a vector per passage, as wide as the encoder's)"
                )
            for start in range(0, len(passages), LOAD_CHUNK):
                chunk = np.array(vectors[start : start + LOAD_CHUNK])  # a copy: the map stays the file's
                if not np.isfinite(chunk).all():
                    raise CorruptArtifact(f"{location}: rows from {start} hold a value that is not finite")
                index.add(chunk)
            del vectors  # the mapped file is closed before its folder is removed
        return cls(index, passages, encoder)


def _flat_index(dimension: int) -> faiss.IndexFlatIP:
    import faiss  # noqa: PLC0415 (see the module's docstring)

    return faiss.IndexFlatIP(dimension)
