"""push_image(): send a local image to an OCI registry as vsnap's artifact (see registry.oci).

Phases: verify image (the trust model and every file, as a restore checks them, under the
image's readers' lock for the whole push, so a capture cannot replace it meanwhile), connect,
plan blobs (the digest of each blob that can be known before sending it), upload blobs (in
parallel; a blob the registry already holds is not sent again: HEAD), push manifest (the config
blob, manifest.json, then the OCI manifest under the tag). An interrupted push leaves whole
blobs in the registry and their digests in _pushed; the next push sends only the rest. With
``model``, the files of the image's model directory travel too, one raw blob each
(registry.model_files): checked in verify image, sent beside the image's, shared by every image
of the model.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, Iterable

from vsnap.host.events import ByteProgress, ProgressCallback, Timings, failpoint
from vsnap.host.trust import open_following_only_roots_links
from vsnap.image.handle import open_image
from vsnap.image.manifest import MANIFEST, MAX_MANIFEST_BYTES, Manifest
from vsnap.image.store import sha256_file
from vsnap.protocol.errors import ImageError, UsageError

from .blobio import HashingIterator, checking, file_chunks, parallel, zstd_chunks
from .client import RegistryClient, per_thread_clients
from .oci import Layer, Reference, build_manifest, encoding_for, parse_reference, sha256_digest
from .model_files import layers_to_push
from .pushed import PushedBlobs

DEFAULT_JOBS = 4


@dataclass(frozen=True)
class PushResult:
    reference: str          # REGISTRY/REPOSITORY:TAG@sha256:... (pull that to get exactly this image)
    digest: str             # the OCI manifest's
    image_dir: Path
    blobs: int
    uploaded: int
    skipped: int            # already in the registry (HEAD)
    bytes_sent: int         # blob bytes sent (compressed where a layer is)
    bytes_skipped: int
    image_bytes: int        # the image's files, uncompressed
    timings: dict[str, float]
    model_files: int = 0    # the model's files pushed beside the image (--model), sent or already there
    model_bytes: int = 0


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.uploaded = self.skipped = self.bytes_sent = self.bytes_skipped = 0

    def add(self, nbytes: int, *, sent: bool) -> None:
        with self._lock:
            if sent:
                self.uploaded += 1
                self.bytes_sent += nbytes
            else:
                self.skipped += 1
                self.bytes_skipped += nbytes


def read_manifest_bytes(image_dir: Path) -> bytes:
    """manifest.json exactly as on disk (it becomes the config blob: its digest is the image's)."""
    fd = open_following_only_roots_links(image_dir / MANIFEST)
    try:
        data = os.read(fd, MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    return data


def push_image(image_dir: Path, reference: str | Reference, *, insecure: bool = False, jobs: int = DEFAULT_JOBS,
               model: bool = False, on_event: ProgressCallback | None = None) -> PushResult:
    """Push ``image_dir`` to ``reference`` (REGISTRY/REPOSITORY[:TAG]); returns the pushed digest.
    ``model``: the model's files too, so that a node without them can pull them."""
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    if ref.digest:
        raise UsageError(f"{ref}: a push names a tag, not a digest (the registry computes the digest)",
                         hint="vsnap push IMAGE REGISTRY/REPOSITORY:TAG")
    image_dir = Path(image_dir).absolute()
    timings = Timings(on_event)
    # trust first (before its lock is made beside it or a byte of it is read); then a capture's
    # publish waits until the push is done. Opened inside the phase, as a restore opens it.
    with ExitStack() as held:
        with timings.phase("verify image"):
            image = held.enter_context(open_image(image_dir))
            manifest = image.manifest
            image.verify_files()
            config = read_manifest_bytes(image_dir)
            if Manifest.model_validate_json(config) != manifest:
                raise ImageError(f"{image_dir / MANIFEST} changed while vsnap read it", hint="push again")
            model_layers = layers_to_push(manifest) if model else {}
        with timings.phase("connect"):
            client = per_thread_clients(ref, insecure=insecure)
            client()
        pushed = PushedBlobs(image_dir)
        stats = {rel: os.lstat(image_dir / rel) for rel in manifest.files}
        with timings.phase("plan blobs"):
            known = _plan(image_dir, manifest, stats, pushed, jobs)
        counters = _Counters()
        # zstd's multi-threaded mode makes the same bytes whatever its thread count (its single-threaded
        # mode other ones): one image pushes as one digest, whatever --jobs and the host's cores
        threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
        cancel = threading.Event()
        one_per_digest = OnePerDigest([*known.values(), *(layer for _, layer in model_layers.values())])
        with timings.phase("upload blobs"):
            progress = timings.progress("upload blobs")  # bytes sent (compressed where a layer is)

            def send(rel: str) -> Layer:
                planned = known.get(rel)
                with one_per_digest.holding(planned):
                    layer = _send(client(), image_dir, rel, manifest, planned, counters, threads, cancel, progress)
                pushed.remember(layer, stats[rel])
                failpoint("blob pushed")
                return layer

            def send_model_file(rel: str) -> Layer:
                path, layer = model_layers[rel]
                with one_per_digest.holding(layer):
                    _send_model_file(client(), path, layer, counters, cancel, progress)
                return layer

            items = [(send, rel, entry.size) for rel, entry in manifest.files.items()]
            items += [(send_model_file, rel, layer.size) for rel, (_, layer) in model_layers.items()]
            items.sort(key=lambda item: -item[2])
            sent = parallel(lambda item: item[0](item[1]), items, jobs, cancel)
            layers = [layer for (fn, _, _), layer in zip(items, sent) if fn is send]
        with timings.phase("push manifest"):
            config_digest = sha256_digest(config)
            if not client().blob_exists(config_digest):
                client().upload_file(io.BytesIO(config), len(config), config_digest)
            document = build_manifest(config, layers, manifest, [layer for _, layer in model_layers.values()])
            client().put_manifest(document, ref.tag or "latest")
    digest = sha256_digest(document)
    tagged = Reference(ref.registry, ref.repository, ref.tag or "latest", digest)
    return PushResult(str(tagged), digest, image_dir, len(layers) + len(model_layers), counters.uploaded,
                      counters.skipped, counters.bytes_sent, counters.bytes_skipped,
                      sum(e.size for e in manifest.files.values()), dict(timings.seconds), len(model_layers),
                      sum(layer.size for _, layer in model_layers.values()))


class OnePerDigest:
    """Files of equal content share one blob: one job at a time asks the registry for it and sends
    it, and the next finds it there. Two at once send it twice, and a registry (distribution 2.8)
    answered HTTP 500 to the HEAD of a blob another connection was committing."""

    def __init__(self, layers: Iterable[Layer]) -> None:
        self._locks = {layer.digest: threading.Lock() for layer in layers}

    def holding(self, layer: Layer | None) -> ContextManager[object]:
        """The digest's turn (a digest known only once sent has no turn to wait for)."""
        return self._locks[layer.digest] if layer is not None else contextlib.nullcontext()


def _plan(image_dir: Path, manifest: Manifest, stats: dict[str, os.stat_result], pushed: PushedBlobs,
          jobs: int) -> dict[str, Layer]:
    """Each file's blob where its digest can be known before sending: a small raw file's is its
    manifest digest, a large raw file's (the weights) its sha256 (remembered from an earlier
    push, else hashed now), a compressed file's only if an earlier push recorded it."""
    known: dict[str, Layer] = {}
    to_hash: list[str] = []
    for rel, entry in manifest.files.items():
        encoding = encoding_for(rel, entry.size)
        if encoding == "raw" and entry.scheme == "sha256":
            known[rel] = Layer(rel, "raw", f"sha256:{entry.digest}", entry.size)
        elif (layer := pushed.known(rel, stats[rel], encoding)) is not None:
            known[rel] = layer
        elif encoding == "raw":
            to_hash.append(rel)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for rel, digest in zip(to_hash, pool.map(lambda r: sha256_file(image_dir / r), to_hash)):
            known[rel] = Layer(rel, "raw", f"sha256:{digest}", manifest.files[rel].size)
    return known


def _send(client: RegistryClient, image_dir: Path, rel: str, manifest: Manifest, layer: Layer | None,
          counters: _Counters, threads: int, cancel: threading.Event, progress: ByteProgress) -> Layer:
    """One file as one blob: skipped if the registry holds its digest, else streamed (zstd as it is
    made); the registry checks the digest given at the end."""
    path = image_dir / rel
    if layer is not None and client.blob_exists(layer.digest):
        counters.add(layer.size, sent=False)
        return layer
    encoding = encoding_for(rel, manifest.files[rel].size)
    chunks = zstd_chunks(path, threads=threads) if encoding == "zstd" else file_chunks(path)
    stream = HashingIterator(chunks, checking(cancel, progress.add),
                             digest=layer.digest if encoding == "raw" and layer else None)
    client.upload_stream(stream, lambda: stream.digest)
    counters.add(stream.size, sent=True)
    return Layer(rel, encoding, stream.digest, stream.size)


def _send_model_file(client: RegistryClient, path: Path, layer: Layer, counters: _Counters,
                     cancel: threading.Event, progress: ByteProgress) -> None:
    """One model file as its raw blob, unless the registry holds it (another image of the model
    sent it): its digest is the sha256 the image records, so a file changed since verify image
    fails the upload (the registry checks the digest given at the end)."""
    if client.blob_exists(layer.digest):
        counters.add(layer.size, sent=False)
        return
    # a model directory of Hugging Face's cache holds root's links into its blobs/: followed (only root's)
    chunks = file_chunks(path, lambda p: open_following_only_roots_links(p, os.O_RDONLY))
    stream = HashingIterator(chunks, checking(cancel, progress.add), digest=layer.digest)
    client.upload_stream(stream, lambda: stream.digest)
    counters.add(stream.size, sent=True)
