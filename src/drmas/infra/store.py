"""The artifact store: folders of files under a local root or ``s3://bucket/prefix``.

Every stage output is an *artifact*: a folder whose files become visible only when its
``_MANIFEST.json`` (file names, sizes, sha256) is written, last. So a writer that is killed
half-way leaves nothing a reader will take for a result, and a reader that finds a file
whose size or hash differs from the manifest refuses it. The layout (docs/architecture.md §4):

    {root}/{experiment}/{run_id}/iter-{i:06d}/{stage}/...files..., _MANIFEST.json

    store = Store.from_config(cfg.store)        # or Store.from_settings(store.settings())
    with store.writer(layout.stage_path(exp, run, 3, "rollout")) as out:
        out.write_table("trajectories.parquet", table, TRAJECTORY_SCHEMA)
    table = store.open(".../rollout").read_table("trajectories.parquet", TRAJECTORY_SCHEMA)

S3 goes through ``pyarrow.fs.S3FileSystem`` against any endpoint (AWS, MinIO, SeaweedFS).
Credentials come from the environment only (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``)
and never appear in messages.

S3 faults are retried at two levels. The AWS SDK retries each HTTP request (a 500/503, a
dropped connection, a stall, a reply cut mid-body) twice, quickly, for a glitch; on top of
that, every store operation (read or write of a whole object, listing, deleting) is
retried whole, with jittered exponential back-off (0.2 s doubling to 8 s), until it
succeeds or ``DRMAS_S3_RETRY_S`` seconds have passed: that rides out outages, throttling
and streaks of faults longer than the SDK's three quick attempts. Writes put whole
objects, so a retry after a lost reply rewrites the same bytes, and the manifest still
goes last. A store that stays down fails the operation with a StoreError naming the
endpoint after about ``DRMAS_S3_RETRY_S`` plus one last attempt (three requests, each
given up after ``DRMAS_S3_REQUEST_TIMEOUT_S`` of silence; curl measures a reply that
stalls mid-body by its average speed, so that one takes a few seconds longer). Wrong keys
or a missing bucket are never retried, nor is an endpoint where nothing listens when the
store is opened (a wrong address, not a fault). Settings, from the environment (so that
Ray workers, which inherit it, use the same, and a resumed run may change them):

    DRMAS_S3_REQUEST_TIMEOUT_S   seconds a request may stay silent before it is retried (30)
    DRMAS_S3_RETRY_S             seconds an operation keeps being retried (120)
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import posixpath
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from drmas.infra import faults
from drmas.infra.schema import check_table

__all__ = [
    "MANIFEST",
    "Artifact",
    "ArtifactExists",
    "ArtifactNotFound",
    "ArtifactWriter",
    "CorruptArtifact",
    "FileEntry",
    "Store",
    "StoreError",
    "StoreSettings",
]

MANIFEST = "_MANIFEST.json"
MANIFEST_FORMAT = "drmas.artifact/1"
CHUNK_BYTES = 8 * 2**20
"""Files put from or read into local files move in chunks of this size."""
S3_CONNECT_TIMEOUT_S = 5.0
S3_REQUEST_ATTEMPTS = 3
"""Attempts per HTTP request, 50 and 100 ms apart (the AWS SDK's default retry strategy):
quick, for a glitch; longer outages are the whole-operation retries' job."""
REQUEST_TIMEOUT_VARIABLE, REQUEST_TIMEOUT_DEFAULT_S = "DRMAS_S3_REQUEST_TIMEOUT_S", 30.0
RETRY_WINDOW_VARIABLE, RETRY_WINDOW_DEFAULT_S = "DRMAS_S3_RETRY_S", 120.0
FIRST_PAUSE_S, LONGEST_PAUSE_S = 0.2, 8.0
"""Back-off between whole-operation attempts: doubling from the first pause, jittered."""
PERMANENT_S3_ERRORS = ("ACCESS_DENIED", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket")
"""Failures that a retry cannot fix: they are reported at once."""
NOTHING_LISTENING = "curlCode: 7,"
"""curl's code for a refused connection (CURLE_COULDNT_CONNECT)."""

log = logging.getLogger(__name__)
Result = TypeVar("Result")


class StoreError(RuntimeError):
    """The store cannot do what was asked; the message names the location and the reason."""


class ArtifactNotFound(StoreError):
    """No complete artifact (no manifest) at a path."""


class ArtifactExists(StoreError):
    """A complete artifact is already there and overwriting was not asked for."""


class CorruptArtifact(StoreError):
    """An artifact whose files do not match its manifest, or whose manifest is unreadable."""


class NothingListening(OSError):
    """A refused connection when the store is opened: a wrong endpoint, not a fault."""


class StoreLocation(Protocol):
    """What opens a store: a run config's ``store`` section or a :class:`StoreSettings`."""

    @property
    def root(self) -> str: ...
    @property
    def endpoint(self) -> str | None: ...
    @property
    def region(self) -> str: ...
    @property
    def lease_timeout_s(self) -> float: ...


@dataclass(frozen=True)
class StoreSettings:
    """Where an open store is and how it is reached (absolute root, resolved endpoint): what
    another process (a Ray actor, a KFP task) needs to open the same store. Plain data of
    the infra layer, so that the store depends on no config schema; no credentials in it
    (they come from the environment)."""

    root: str
    endpoint: str | None = None
    region: str = "us-east-1"
    lease_timeout_s: float = 60.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, for a process started with plain arguments."""
        return asdict(self)


@dataclass(frozen=True)
class FileEntry:
    """One file of an artifact as its manifest records it."""

    size: int
    sha256: str


class Store:
    """A root folder, local or on S3, holding artifacts."""

    def __init__(
        self, root: str, endpoint: str | None = None, region: str = "us-east-1", lease_timeout_s: float = 60.0
    ) -> None:
        self.root = root.rstrip("/") if root.startswith("s3://") else str(Path(root).resolve())
        self.is_s3 = root.startswith("s3://")
        self.region = region
        self.lease_timeout_s = lease_timeout_s
        """How long a run's lease outlives its holder's last heartbeat (drmas.infra.lease)."""
        self.write_guard: Callable[[], None] | None = None
        """Called before an artifact is opened, before each of its files and before its
        manifest: the check of the run lease this process holds (drmas.infra.lease), which
        raises once the lease is lost, so that a writer that lost its run stops writing."""
        self.retry_window_s = 0.0
        if self.is_s3:
            self.endpoint = _resolve_endpoint(endpoint)
            self.retry_window_s = _seconds_from_environment(RETRY_WINDOW_VARIABLE, RETRY_WINDOW_DEFAULT_S)
            self.fs, self.base = _s3_filesystem(self.root, self.endpoint, region), self.root[5:]
            self._check_bucket()
        else:
            self.endpoint = None
            self.fs, self.base = pafs.LocalFileSystem(), self.root

    @classmethod
    def from_config(cls, location: StoreLocation) -> Store:
        """The store a config's ``store`` section (or another store's settings) names."""
        return cls(location.root, location.endpoint, location.region, location.lease_timeout_s)

    def settings(self) -> StoreSettings:
        """This store's location, for other processes to open it (``Store.from_config``)."""
        return StoreSettings(self.root, self.endpoint, self.region, self.lease_timeout_s)

    def __repr__(self) -> str:
        where = f" at {self.endpoint}" if self.endpoint else ""
        return f"Store({self.root!r}{where})"

    # ----------------------------------------------------------------------------------

    def uri(self, path: str, name: str | None = None) -> str:
        """The full address of an artifact (or a file in it), for lineage and messages."""
        relative = _clean(path) if name is None else f"{_clean(path)}/{_clean(name)}"
        return f"{self.root}/{relative}"

    def writer(self, path: str, overwrite: bool = False, meta: dict[str, Any] | None = None):
        """A context manager that writes the artifact at ``path``; the manifest goes last.

        An existing complete artifact is refused unless ``overwrite``; then its manifest
        is removed first, so no reader sees a mix of old and new files.
        """
        return ArtifactWriter(self, _clean(path), overwrite, dict(meta or {}))

    def put_part(self, path: str, local_path: str | Path, name: str) -> FileEntry:
        """One file put, streamed, into the artifact at ``path`` that another process's
        writer has opened and will commit (``ArtifactWriter.adopt``: one rank's optimizer
        shard, drmas.training.shards); its manifest entry. The write guard is checked as
        a writer's."""
        part = ArtifactWriter(self, _clean(path), overwrite=True, meta={})  # never opened nor committed
        part.put_file(local_path, name)
        return part.files[_clean(name)]

    def exists(self, path: str) -> bool:
        """Whether a complete artifact (one with a manifest) is at ``path``."""
        info = self._call(self.fs.get_file_info, self._abs(path, MANIFEST))
        return info.type == pafs.FileType.File

    def open(self, path: str) -> Artifact:
        """The complete artifact at ``path``; ArtifactNotFound if it has no manifest."""
        path = _clean(path)
        try:
            raw = self._read(self._abs(path, MANIFEST))
        except FileNotFoundError:
            raise ArtifactNotFound(f"no complete artifact at {self.uri(path)} (no {MANIFEST})") from None
        return Artifact(self, path, *_parse_manifest(raw, self.uri(path, MANIFEST)))

    def fingerprint(self, path: str, ignore: tuple[str, ...] = ()) -> str:
        """The fingerprint of the artifact at ``path`` (``Artifact.fingerprint``)."""
        return self.open(path).fingerprint(ignore)

    def list(self, prefix: str = "") -> list[str]:
        """Paths of the complete artifacts under ``prefix``, sorted."""
        selector = pafs.FileSelector(self._abs(prefix), recursive=True, allow_not_found=True)
        infos = self._call(self.fs.get_file_info, selector)
        base_length = len(self.base) + 1
        return sorted(
            posixpath.dirname(info.path[base_length:])
            for info in infos
            if info.type == pafs.FileType.File and posixpath.basename(info.path) == MANIFEST
        )

    def delete(self, path: str, retry: bool = True) -> None:
        """Remove an artifact: the manifest first (it disappears for readers), then files."""
        self._call(self._delete_if_present, self._abs(path, MANIFEST), pafs.FileType.File, retry=retry)
        self._call(self._delete_if_present, self._abs(path), pafs.FileType.Directory, retry=retry)

    # Plain objects, outside the artifact layout (question files and corpora named by an
    # s3:// URI): named by their filesystem path, ``bucket/key`` on S3.

    def object_info(self, target: str | pafs.FileSelector) -> Any:
        """The filesystem's FileInfo of ``target``, or the list of every entry under a
        FileSelector; retried as the store's own calls are."""
        return self._call(self.fs.get_file_info, target)

    def read_object(self, key: str) -> bytes:
        """A whole object; FileNotFoundError when there is none."""
        return self._read(key)

    def object_chunks(self, key: str, size: int, chunk_bytes: int) -> Iterator[bytes]:
        """The first ``size`` bytes of an object in ranged reads of ``chunk_bytes``, each
        retried alone (a read at an offset is idempotent), never held whole; it stops early
        when the object ends first (the caller counts what it got)."""
        offset = 0
        with self._call(self.fs.open_input_file, key) as handle:
            while offset < size:
                chunk = self._call(_read_at, key, handle, min(chunk_bytes, size - offset), offset)
                if not chunk:
                    return
                offset += len(chunk)
                yield chunk

    # ----------------------------------------------------------------------------------

    def _abs(self, path: str, name: str | None = None) -> str:
        parts = [self.base, _clean(path)] + ([_clean(name)] if name else [])
        return "/".join(part for part in parts if part)

    def _read(self, absolute: str) -> bytes:
        """A whole file; on S3 a failed or cut transfer is read again from the start."""
        return self._call(self._get, absolute)

    def _write(self, absolute: str, data: bytes) -> None:
        """A whole file; on S3 a failed upload is put again, whole (PUT is idempotent)."""
        if not self.is_s3:
            self._call(self.fs.create_dir, posixpath.dirname(absolute))
        self._call(self._put, absolute, data)

    def _write_from(self, absolute: str, local_path: Path) -> str:
        """A whole file from a local one, in chunks; its sha256. On S3 a failed upload is
        put again, whole, from the start of the local file."""
        if not self.is_s3:
            self._call(self.fs.create_dir, posixpath.dirname(absolute))
        return self._call(self._put_from, absolute, local_path)

    def _put_from(self, absolute: str, local_path: Path) -> str:
        digest = hashlib.sha256()
        with open(local_path, "rb") as source, self.fs.open_output_stream(absolute) as stream:
            while chunk := source.read(CHUNK_BYTES):
                digest.update(chunk)
                stream.write(chunk)
        return digest.hexdigest()

    def _read_into(self, absolute: str, target: Path) -> tuple[int, str]:
        """A whole file into a local one, in chunks: its size and sha256. On S3 a failed or
        cut transfer is read again from the start."""
        return self._call(self._get_into, absolute, target)

    def _get_into(self, absolute: str, target: Path) -> tuple[int, str]:
        digest, size = hashlib.sha256(), 0
        with self.fs.open_input_stream(absolute) as stream, open(target, "wb") as out:
            while chunk := stream.read(CHUNK_BYTES):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
        return size, digest.hexdigest()

    def _write_atomically(self, absolute: str, data: bytes) -> None:
        """S3 objects appear whole on upload; a local file is renamed into place."""
        if self.is_s3:
            self._write(absolute, data)
            return
        self._call(self.fs.create_dir, posixpath.dirname(absolute))
        self._call(replace_atomically, absolute, data)

    def _get(self, absolute: str) -> bytes:
        with self.fs.open_input_stream(absolute) as stream:
            return stream.read()

    def _put(self, absolute: str, data: bytes) -> None:
        with self.fs.open_output_stream(absolute) as stream:
            stream.write(data)

    def _delete_if_present(self, absolute: str, kind: pafs.FileType) -> None:
        """Look, then delete: one unit, so that a retry after a lost reply looks again."""
        if self.fs.get_file_info(absolute).type == kind:
            (self.fs.delete_file if kind == pafs.FileType.File else self.fs.delete_dir)(absolute)

    def _call(self, function: Callable[..., Result], *args: Any, retry: bool = True) -> Result:
        """Run a filesystem operation, turning failures into StoreErrors that say what to
        do. On S3 a transient failure is retried, whole, with back-off, for up to the retry
        window; ``retry=False`` gives it one attempt (best-effort cleanup)."""
        target = args[0] if args else ""
        attempt, started = 1, time.monotonic()
        while True:
            try:
                return function(*args)
            except FileNotFoundError:
                raise
            except OSError as error:
                pause = min(LONGEST_PAUSE_S, FIRST_PAUSE_S * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                elapsed = time.monotonic() - started
                retrying = retry and self._is_transient(error)
                if not retrying or elapsed + pause > self.retry_window_s:
                    failure = self._explain(error, target)
                    if retrying:
                        failure = StoreError(
                            f"{failure} (gave up after {attempt} attempt{'s' * (attempt > 1)} in {elapsed:.1f} s)"
                        )
                    raise failure from None
                log.warning(
                    "S3 at %s: %s failed (%s); attempt %d in %.1f s",
                    self.endpoint,
                    target,
                    _curl_detail(str(error)),
                    attempt + 1,
                    pause,
                )
                time.sleep(pause)
                attempt += 1

    def _info_unless_nothing_listens(self, path: str) -> pafs.FileInfo:
        try:
            return self.fs.get_file_info(path)
        except OSError as error:
            if NOTHING_LISTENING in str(error):
                raise NothingListening(str(error)) from None
            raise

    def _is_transient(self, error: OSError) -> bool:
        """Whether a retry may succeed: any S3 failure but wrong keys, a missing bucket,
        or nothing listening at the endpoint when the store is opened."""
        text = str(error)
        return (
            self.is_s3 and not isinstance(error, NothingListening) and not any(m in text for m in PERMANENT_S3_ERRORS)
        )

    def _explain(self, error: OSError, target: Any) -> StoreError:
        text = str(error)
        where = f"{self.endpoint}" if self.endpoint else self.root
        if not self.is_s3:
            return StoreError(_local_failure(error, target))
        if "ACCESS_DENIED" in text or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
            return StoreError(
                f"S3 at {where} denied access to {self.root}: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            )
        if "NETWORK_CONNECTION" in text or "curlCode" in text or "timed out" in text.lower():
            return StoreError(f"cannot reach the S3 endpoint {where}: {_curl_detail(text)}")
        if "NoSuchBucket" in text or "Bucket" in text and "not found" in text:
            return StoreError(f"bucket of {self.root} does not exist at {where}")
        return StoreError(f"S3 error at {where} on {target}: {text}")

    def _check_bucket(self) -> None:
        """Fail fast, at construction, on a wrong endpoint, wrong keys or a missing bucket;
        an endpoint that answers badly (5xx, dropped or stalled replies) is retried."""
        bucket = self.base.split("/", 1)[0]
        info = self._call(self._info_unless_nothing_listens, bucket)
        if info.type == pafs.FileType.NotFound:
            raise StoreError(f"bucket {bucket!r} does not exist at {self.endpoint or 'AWS'}; create it first")


def _read_at(key: str, handle: pa.NativeFile, size: int, offset: int) -> bytes:
    """``size`` bytes of ``handle`` from ``offset`` (``key`` first: the store's messages name it)."""
    return handle.read_at(size, offset)


@dataclass
class Artifact:
    """A complete artifact: read its files, each checked against the manifest."""

    store: Store
    path: str
    files: dict[str, FileEntry]
    meta: dict[str, Any]

    @property
    def uri(self) -> str:
        return self.store.uri(self.path)

    def read_bytes(self, name: str) -> bytes:
        """The file's bytes, refused if their size or sha256 differs from the manifest."""
        entry = self._entry(name)
        location = self.store.uri(self.path, name)
        try:
            data = self.store._read(self.store._abs(self.path, name))
        except FileNotFoundError:
            raise CorruptArtifact(f"{location}: listed in the manifest but missing") from None
        if len(data) != entry.size:
            raise CorruptArtifact(
                f"{location}: {len(data)} bytes, but the manifest says {entry.size} (truncated or modified?)"
            )
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise CorruptArtifact(f"{location}: sha256 differs from the manifest (modified?)")
        return data

    def fingerprint(self, ignore: tuple[str, ...] = ()) -> str:
        """A hash of the artifact's content (its files' names and sha256 from the manifest,
        except the ``ignore``d names): equal for two artifacts exactly when their files are."""
        entries = sorted((name, entry.sha256) for name, entry in self.files.items() if name not in ignore)
        return hashlib.sha256(json.dumps(entries).encode()).hexdigest()

    def check_sizes(self) -> None:
        """Refuse, without reading them, files that are missing or whose size differs from the
        manifest (a cut copy, a truncated write): what a resume checks of the checkpoint it
        starts from before it starts anything. Their sha256 is checked when they are read."""
        names = sorted(self.files)
        infos = self.store._call(self.store.fs.get_file_info, [self.store._abs(self.path, name) for name in names])
        for name, info in zip(names, infos, strict=True):
            location, expected = self.store.uri(self.path, name), self.files[name].size
            if info.type != pafs.FileType.File:
                raise CorruptArtifact(f"{location}: listed in the manifest but missing")
            if info.size != expected:
                raise CorruptArtifact(
                    f"{location}: {info.size} bytes, but the manifest says {expected} (truncated or modified?)"
                )

    def read_table(
        self, name: str, schema: pa.Schema | None = None, dictionary_columns: list[str] | None = None
    ) -> pa.Table:
        """A Parquet file as an Arrow table, checked against ``schema`` when given.

        ``dictionary_columns`` are read dictionary-encoded (cheap to group by).
        """
        location = self.store.uri(self.path, name)
        buffer = pa.BufferReader(self.read_bytes(name))
        try:
            table = pq.read_table(buffer, read_dictionary=dictionary_columns)
        except (pa.ArrowException, OSError) as error:
            raise CorruptArtifact(f"{location}: not a readable Parquet file ({error})") from None
        return check_table(table, schema, location) if schema is not None else table

    def read_json(self, name: str) -> Any:
        try:
            return json.loads(self.read_bytes(name))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CorruptArtifact(f"{self.store.uri(self.path, name)}: not JSON ({error})") from None

    def download(self, local_dir: str | Path, prefix: str = "", only: Callable[[str], bool] | None = None) -> Path:
        """Copy the files under ``prefix`` (those whose name below it ``only`` accepts) into
        ``local_dir`` (verified), keeping sub-folders."""
        local_dir = Path(local_dir)
        for name in self.files:
            if prefix and not name.startswith(prefix.rstrip("/") + "/"):
                continue
            relative = name[len(prefix.rstrip("/")) + 1 :] if prefix else name
            if only is None or only(relative):
                self.download_file(relative, local_dir, prefix)
        return local_dir

    def download_file(self, relative: str, local_dir: str | Path, prefix: str = "") -> Path:
        """One file under ``prefix`` into ``local_dir`` (verified, streamed): its path."""
        target = Path(local_dir) / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        self._read_verified_into(f"{prefix.rstrip('/')}/{relative}" if prefix else relative, target)
        return target

    def _read_verified_into(self, name: str, target: Path) -> None:
        """The file streamed into ``target`` (never whole in memory), refused as
        ``read_bytes`` refuses it; a refused copy is removed."""
        entry = self._entry(name)
        location = self.store.uri(self.path, name)
        try:
            size, digest = self.store._read_into(self.store._abs(self.path, name), target)
        except FileNotFoundError:
            raise CorruptArtifact(f"{location}: listed in the manifest but missing") from None
        if size != entry.size or digest != entry.sha256:
            target.unlink()
            if size != entry.size:
                raise CorruptArtifact(
                    f"{location}: {size} bytes, but the manifest says {entry.size} (truncated or modified?)"
                )
            raise CorruptArtifact(f"{location}: sha256 differs from the manifest (modified?)")

    def _entry(self, name: str) -> FileEntry:
        if name not in self.files:
            listed = ", ".join(sorted(self.files)) or "no files"
            raise CorruptArtifact(f"{self.uri}: has no file {name!r} (it has {listed})")
        return self.files[name]


@dataclass
class ArtifactWriter:
    """Writes the files of one artifact, then its manifest; on error, leaves no manifest."""

    store: Store
    path: str
    overwrite: bool
    meta: dict[str, Any]
    files: dict[str, FileEntry] = field(default_factory=dict)
    fenced: bool = False
    """The store's write guard stopped this writer: the artifact is left as it is (another
    process holds the run now and may be writing it)."""

    def __enter__(self) -> ArtifactWriter:
        self._guard()
        if self.store.exists(self.path):
            if not self.overwrite:
                raise ArtifactExists(
                    f"{self.store.uri(self.path)} already holds a complete artifact; "
                    "refusing to overwrite it (pass overwrite/--force to replace it)"
                )
        # Files without a manifest are leftovers of a writer that died: never visible, drop them.
        self.store.delete(self.path)
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:
            self._discard()
            return
        try:
            self._guard()
            self._write_manifest()
        except BaseException:
            self._discard()
            raise

    def write_bytes(self, name: str, data: bytes) -> str:
        """Write one file; returns its URI."""
        name = _clean(name)
        if name == MANIFEST or name in self.files:
            raise StoreError(f"{self.store.uri(self.path, name)}: written twice or reserved")
        self._guard()
        absolute = self.store._abs(self.path, name)
        faults.reached(self.path, len(self.files) + 1, lambda: self.store._write(absolute, data[: len(data) // 2]))
        self.store._write(absolute, data)
        self.files[name] = FileEntry(len(data), hashlib.sha256(data).hexdigest())
        return self.store.uri(self.path, name)

    def write_table(self, name: str, table: pa.Table, schema: pa.Schema | None = None) -> str:
        """Write a Parquet file (zstd), checked against ``schema`` first when given."""
        if schema is not None:
            table = check_table(table, schema, self.store.uri(self.path, name)).cast(schema)
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        return self.write_bytes(name, sink.getvalue())

    def write_json(self, name: str, obj: Any) -> str:
        return self.write_bytes(name, json.dumps(obj, indent=2, sort_keys=True).encode())

    def put_file(self, local_path: str | Path, name: str) -> str:
        """Write one file from a local one, streamed in chunks (an optimizer state of tens of
        GB is never held in memory); returns its URI."""
        name, local_path = _clean(name), Path(local_path)
        if name == MANIFEST or name in self.files:
            raise StoreError(f"{self.store.uri(self.path, name)}: written twice or reserved")
        self._guard()
        absolute = self.store._abs(self.path, name)
        size = local_path.stat().st_size
        faults.reached(
            self.path, len(self.files) + 1, lambda: self.store._write(absolute, _head(local_path, size // 2))
        )
        digest = self.store._write_from(absolute, local_path)
        self.files[name] = FileEntry(size, digest)
        return self.store.uri(self.path, name)

    def adopt(self, name: str, entry: FileEntry) -> None:
        """A file another process put into this artifact (``Store.put_part``), listed in the
        manifest with the size and sha256 it measured while uploading."""
        name = _clean(name)
        if name == MANIFEST or name in self.files:
            raise StoreError(f"{self.store.uri(self.path, name)}: written twice or reserved")
        self._guard()
        self.files[name] = entry

    def put_dir(self, local_dir: str | Path, prefix: str) -> list[str]:
        """Upload every file under ``local_dir`` as ``prefix/relative/path``."""
        local_dir = Path(local_dir)
        return [
            self.put_file(path, f"{prefix}/{path.relative_to(local_dir).as_posix()}")
            for path in sorted(local_dir.rglob("*"))
            if path.is_file()
        ]

    def _write_manifest(self) -> None:
        manifest = {
            "format": MANIFEST_FORMAT,
            "files": {name: vars(entry) for name, entry in sorted(self.files.items())},
            "meta": self.meta,
        }
        data = json.dumps(manifest, indent=2, sort_keys=True).encode()
        faults.reached(self.path, "manifest")
        self.store._write_atomically(self.store._abs(self.path, MANIFEST), data)

    def _guard(self) -> None:
        if self.store.write_guard is None:
            return
        try:
            self.store.write_guard()
        except BaseException:
            self.fenced = True
            raise

    def _discard(self) -> None:
        """Best effort, one attempt: a store that is down already cost the retry window.
        A fenced writer discards nothing: the files may be the new holder's."""
        if self.fenced:
            return
        try:
            self.store.delete(self.path, retry=False)
        except (StoreError, OSError):
            pass  # the manifest was never written, so what is left is invisible anyway


def _parse_manifest(raw: bytes, location: str) -> tuple[dict[str, FileEntry], dict[str, Any]]:
    try:
        manifest = json.loads(raw)
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format is {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        files = {
            _clean(name): FileEntry(int(entry["size"]), str(entry["sha256"]))
            for name, entry in manifest["files"].items()
        }
        return files, dict(manifest.get("meta", {}))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptArtifact(f"{location}: unreadable manifest ({error})") from None


def _head(local_path: Path, size: int) -> bytes:
    """The first ``size`` bytes of a local file (a torn write's half, for fault tests)."""
    with open(local_path, "rb") as source:
        return source.read(size)


def _clean(path: str) -> str:
    """A relative POSIX path with no '..', '.' or empty parts (manifests are input too)."""
    parts = [part for part in str(path).replace("\\", "/").split("/") if part not in ("", ".")]
    if any(part == ".." for part in parts):
        raise StoreError(f"path {path!r} may not contain '..'")
    return "/".join(parts)


def _resolve_endpoint(endpoint: str | None) -> str | None:
    return endpoint or os.environ.get("DRMAS_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")


def _seconds_from_environment(variable: str, default: float) -> float:
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        seconds = float(text)
        if seconds > 0:
            return seconds
    except ValueError:
        pass
    raise StoreError(f"{variable}={text!r}: must be a number of seconds above 0")


def _s3_filesystem(root: str, endpoint: str | None, region: str) -> pafs.S3FileSystem:
    if not re.match(r"^s3://[a-z0-9][a-z0-9.\-]{1,62}(/|$)", root):
        raise StoreError(f"store root {root!r} is not s3://bucket[/prefix] with a valid bucket name")
    options: dict[str, Any] = {
        "region": region,
        "connect_timeout": S3_CONNECT_TIMEOUT_S,
        "request_timeout": _seconds_from_environment(REQUEST_TIMEOUT_VARIABLE, REQUEST_TIMEOUT_DEFAULT_S),
        "retry_strategy": pafs.AwsDefaultS3RetryStrategy(max_attempts=S3_REQUEST_ATTEMPTS),
    }
    if endpoint:
        match = re.match(r"^(https?)://([^/@\s]+)/?$", endpoint)
        if not match:
            raise StoreError("S3 endpoint must look like http(s)://host:port")
        options["scheme"], options["endpoint_override"] = match.group(1), match.group(2)
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        options["access_key"] = os.environ["AWS_ACCESS_KEY_ID"]
        options["secret_key"] = os.environ["AWS_SECRET_ACCESS_KEY"]
        if os.environ.get("AWS_SESSION_TOKEN"):
            options["session_token"] = os.environ["AWS_SESSION_TOKEN"]
    return pafs.S3FileSystem(**options)


def _curl_detail(text: str) -> str:
    match = re.search(r"Details: (.*)$", text)
    return match.group(1).strip() if match else text.splitlines()[0]


def replace_atomically(absolute: str, data: bytes) -> None:
    """Write a temporary file beside ``absolute``, sync it, and rename it into place."""
    temporary = f"{absolute}.tmp-{os.getpid()}"
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, absolute)


def _local_failure(error: OSError, target: Any) -> str:
    """``path: reason``, the reason in the system's words (pyarrow wraps them in its own)."""
    out_of_room = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    number = error.errno or next((e for e in out_of_room if os.strerror(e) in str(error)), None)
    reason = os.strerror(number) if number else str(error)
    if number in out_of_room:
        reason += " (no room left for the store: free space, then resume the run)"
    return f"{target}: {reason}"
