"""pull_image(): fetch vsnap's artifact from an OCI registry into a new image directory.

Phases: preflight (the target path as a capture checks it, its parent root's, the image lock),
connect, fetch manifest (the OCI manifest, bounded and checked, then its config blob: the image's
manifest.json, read and version-checked as a local one, its paths checked, matched to the layers,
the sizes checked against free disk), download blobs (in parallel, each checked as it is written:
registry.blobio; a large raw one, the weights, as byte ranges side by side: registry.ranged),
verify (the trust model and every file against manifest.json, as a restore does), place model
(with --model-dir: the model's files into the model directory: registry.model_files), publish
(one rename).

Everything is written into a private staging directory beside the target,
``.NAME.pull-<first 16 hex digits of the manifest digest>``: a blob in flight lives under its
``.incoming/`` and is renamed to its file's path only once its digests matched. Nothing appears
under the final name before the publish; an interrupted pull leaves the staging directory, and
the next pull of the same manifest to the same path keeps each file it finds there that is still
the one that was checked (_verified's record, else hashed again) and fetches the rest.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vsnap.host import verified
from vsnap.host.events import ByteProgress, ProgressCallback, Timings, failpoint
from vsnap.host.paths import DEFAULT_IMAGE_ROOT, require_safe_directory
from vsnap.image.manifest import MANIFEST, FileEntry, Manifest, read_manifest
from vsnap.image.origin import manifest_sha256, record_origin
from vsnap.image.store import (
    HASH_THREADS,
    PIECE,
    check_parent,
    image_lock,
    image_read_lock,
    is_vsnap_image,
    leftovers,
    make_or_adopt_staging_dir,
    piece_hashes,
    publish,
    require_replaceable,
    require_trust,
    sha256_file,
    verify_files,
)
from vsnap.protocol.control import write_atomic
from vsnap.protocol.errors import ArtifactError, HostNotReady, ImageTampered, ImageUntrusted

from . import model_files, ranged
from .blobio import checking, parallel, write_blob
from .client import RegistryClient, per_thread_clients
from .oci import (
    ALTERED_HINT,
    INCOMING,
    MAX_OCI_MANIFEST_BYTES,
    OCI_MANIFEST,
    Artifact,
    Layer,
    Reference,
    match_manifest,
    parse_artifact,
    parse_reference,
    sha256_digest,
)

DEFAULT_JOBS = 4
SPACE_MARGIN = 64 << 20
RECORD_EVERY_S = 1.0  # the verified record is written at most this often during a pull (and at its end)
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class PullResult:
    image_dir: Path
    reference: str          # REGISTRY/REPOSITORY[:TAG]@sha256:... : what was pulled, pinned
    digest: str
    files: int
    downloaded: int         # the image's blobs fetched now
    reused: int             # image files an interrupted pull had already fetched and checked
    bytes_received: int     # the image's blob bytes fetched now (compressed where a layer is)
    image_bytes: int
    staging: Path | None    # None: the image was there already (a pull of its model alone)
    timings: dict[str, float]
    ranged: int = 0         # files fetched as byte ranges side by side (registry.ranged)
    model_dir: Path | None = None  # where the model's files were put (pull --model-dir)
    model_files: int = 0    # the model's files the artifact carries
    model_fetched: int = 0  # of them fetched now (the others were there already, or not asked for)
    model_bytes: int = 0    # the model files' bytes
    model_bytes_received: int = 0  # the model's blob bytes fetched now
    model_recorded: str = ""  # the model directory the image records (where a restore needs those files)
    image_was_there: bool = False  # the same image (manifest.json's digest) stood at the target: only the model pulled


def default_image_dir(reference: Reference) -> Path:
    return Path(DEFAULT_IMAGE_ROOT) / reference.name


def staging_dir(image_dir: Path, digest: str) -> Path:
    return image_dir.parent / f".{image_dir.name}.pull-{digest.removeprefix('sha256:')[:16]}"


def make_or_adopt_staging(image_dir: Path, digest: str) -> Path:
    """This pull's staging directory beside the image (store.make_or_adopt_staging_dir); other
    pulls' leftovers for this path are removed."""
    staging = staging_dir(image_dir, digest)
    return make_or_adopt_staging_dir(staging, leftovers(image_dir, r"\.pull-[0-9a-f]{16}"),  # NAME literally, not a glob
                                 "this pull", f"remove {staging} yourself if it is yours to delete, or pull --to "
                                              "another path")


def pull_image(reference: str | Reference, *, to: Path | None = None, force: bool = False, insecure: bool = False,
               jobs: int = DEFAULT_JOBS, parts: int | None = None, model_dir: Path | None = None,
               on_event: ProgressCallback | None = None) -> PullResult:
    """Pull ``reference`` into ``to`` (default /var/lib/vsnap/images/<repository's last part>).
    ``parts``: how many byte ranges a large raw layer is fetched in (default: VSNAP_PULL_PARTS,
    else registry.ranged.DEFAULT_PARTS; 1: every blob in one stream). ``model_dir``: also put
    the model's files the artifact carries there (it must be the directory the image records); if
    the same image (its manifest.json's digest) already stands at ``to``, only the model is pulled."""
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    parts = ranged.parts_wanted(parts)
    image_dir = Path(to or default_image_dir(ref)).absolute()
    timings = Timings(on_event)
    with timings.phase("preflight"):
        require_safe_directory(str(image_dir), "the image")
        check_parent(image_dir)
        if model_dir is None:  # else decided once the manifest is known: the same image there is kept
            require_replaceable(image_dir, force, elsewhere="pull into another --to")
    with image_lock(image_dir), ExitStack() as held:  # one capture or pull per image path (held: its model dir)
        with timings.phase("connect"):
            client = per_thread_clients(ref, insecure=insecure)
            client()
        with timings.phase("fetch manifest"):
            artifact, config = _fetch_artifact(client(), ref)
            there = model_dir is not None and not force and _same_image_there(image_dir, artifact)
            if there:  # only its model is wanted: the image stays as it is, once it is whole
                manifest, staging = _image_there(image_dir, artifact), None
            else:
                require_replaceable(image_dir, force, elsewhere="pull into another --to")
                manifest, staging = _stage_manifest(ref, image_dir, artifact, config)
            model = (model_files.prepare(model_dir, manifest, artifact, image_dir=image_dir, held=held)
                     if model_dir is not None else None)
            _require_space(ref, image_dir, ([(staging, manifest.files)] if staging is not None else [])
                           + ([(model.staging, model.entries)] if model is not None else []))
        with timings.phase("download blobs"):
            progress = timings.progress("download blobs", 0)  # each file set adds what it must fetch
            reference = str(artifact.reference)
            # the model first: the image is published only once its model is in place
            fetching = _Downloads(model.staging, model.entries, model.layers, reference, parts, progress) \
                if model is not None else None
            fetched = _Downloads(staging, manifest.files, {layer.path: layer for layer in artifact.layers},
                                 reference, parts, progress) if staging is not None else None
            for download in (fetching, fetched):
                if download is None:
                    continue
                try:
                    download.run(client, jobs)
                except OSError as exc:
                    if exc.errno not in DISK_ERRNOS:
                        raise
                    raise _disk_full(ref, download.staging, len(download.checked), len(download.entries)) from None
        if staging is not None:
            with timings.phase("verify"):
                verify_files(staging, manifest, cache_root=verified.VERIFIED_DIR)  # the trust model, every file
        if model is not None:
            with timings.phase("place model"):
                model_files.place(model, fetching.checked if fetching is not None else None)
        if staging is not None:
            with timings.phase("publish"):
                with image_read_lock(image_dir, exclusive=True):  # no restore is reading an older image there
                    publish(staging, image_dir)
                verified.remember(image_dir, {rel: (os.lstat(image_dir / rel), entry.digest)
                                              for rel, entry in manifest.files.items()})
                verified.forget(staging)
                record_origin(image_dir, reference)  # `vsnap images`: where it came from
    return PullResult(
        image_dir=image_dir, reference=reference, digest=artifact.reference.digest or "", files=len(manifest.files),
        downloaded=fetched.downloaded if fetched else 0, reused=fetched.reused if fetched else len(manifest.files),
        bytes_received=fetched.bytes_received if fetched else 0,
        image_bytes=sum(e.size for e in manifest.files.values()), staging=staging, timings=dict(timings.seconds),
        ranged=sum(d.ranged for d in (fetching, fetched) if d is not None),
        model_dir=model.model_dir if model is not None else None, model_files=len(artifact.model_layers),
        model_fetched=fetching.downloaded if fetching else 0,
        model_bytes=sum(layer.size for layer in artifact.model_layers),
        model_bytes_received=fetching.bytes_received if fetching else 0, model_recorded=manifest.launch.model,
        image_was_there=there)


def _same_image_there(image_dir: Path, artifact: Artifact) -> bool:
    """An image stands at ``image_dir`` whose manifest.json is the artifact's config, byte for byte:
    a real directory of root's that only root may write (a link, or another user's directory, is
    never taken as the image: require_replaceable then refuses it as any pull over it)."""
    try:
        st = os.lstat(image_dir)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return False
    return is_vsnap_image(image_dir) and f"sha256:{manifest_sha256(image_dir)}" == artifact.config_digest


def _image_there(image_dir: Path, artifact: Artifact) -> Manifest:
    """The manifest of the same image at ``image_dir``, once every file of it is checked (the trust
    model, each file's size and sha256, the verified record sparing what this host hashed): an image
    damaged or altered there is refused, never reported as pulled."""
    manifest = read_manifest(image_dir)
    require_trust(image_dir, manifest)
    match_manifest(artifact, manifest)
    try:
        verify_files(image_dir, manifest, cache_root=verified.VERIFIED_DIR)
        if f"sha256:{manifest_sha256(image_dir)}" != artifact.config_digest:  # changed meanwhile (root alone can)
            raise ImageTampered(MANIFEST, artifact.config_digest, "another manifest.json")
    except ImageTampered as exc:
        exc.hint = "the image there was altered or damaged: pull again with --force to replace it"
        raise
    return manifest


def _disk_full(ref: Reference, staging: Path, kept: int, files: int) -> HostNotReady:
    """A pull that filled the disk says what it keeps (a staging directory the next pull resumes
    from), never that nothing was left (what the CLI says of other full-disk errors)."""
    return HostNotReady("disk", f"the disk filled while pulling {ref} into {staging.parent}: {kept} of {files} "
                                f"files are fetched and checked, kept in {staging}",
                        hint="free space there and pull again: it resumes with the files kept")


def _require_space(ref: Reference, image_dir: Path, stagings: list[tuple[Path, dict[str, FileEntry]]]) -> None:
    """Free space for the files each staging directory does not hold yet (a resumed pull's own
    blobs are not counted twice), per filesystem: the image's and the model directory's may share
    one."""
    needs: dict[int, tuple[Path, int]] = {}
    for staging, entries in stagings:
        need = sum(entry.size for rel, entry in entries.items() if not os.path.lexists(staging / rel))
        device = os.stat(staging).st_dev
        where, before = needs.get(device, (staging.parent, 0))
        needs[device] = (where, before + need)
    for where, need in needs.values():
        st = os.statvfs(where)
        free = st.f_bavail * st.f_frsize
        if need + SPACE_MARGIN > free:
            raise HostNotReady("disk", f"not enough space to pull {ref} into {where}: "
                                       f"{need / 1e6:.0f} MB needed, {free / 1e6:.0f} MB free",
                               hint="free space there, or pull --to a directory on another disk")


def _fetch_artifact(client: RegistryClient, ref: Reference) -> tuple[Artifact, bytes]:
    """The OCI manifest, checked, and its config blob (manifest.json's bytes), checked against its digest."""
    data, content_type = client.get_manifest(MAX_OCI_MANIFEST_BYTES)
    if content_type and content_type != OCI_MANIFEST:
        raise ArtifactError(str(ref), f"{ref} is not an OCI image manifest (Content-Type {content_type[:80]})",
                            hint="is REF an image pushed by `vsnap push`?")
    artifact = parse_artifact(data, ref)
    config = client.read_blob(artifact.config_digest, artifact.config_size)
    if len(config) != artifact.config_size or sha256_digest(config) != artifact.config_digest:
        raise ArtifactError(str(ref), f"{ref}: its manifest.json blob does not match its digest",
                            file=MANIFEST, hint="the registry's copy was altered or damaged; push the image again")
    return artifact, config


def _stage_manifest(ref: Reference, image_dir: Path, artifact: Artifact, config: bytes) -> tuple[Manifest, Path]:
    """The staging directory with manifest.json in it, and every check that needs no payload."""
    staging = make_or_adopt_staging(image_dir, artifact.reference.digest or "")
    shutil.rmtree(staging / INCOMING, ignore_errors=True)  # partial blobs of a failed pull: free before counting
    try:
        write_atomic(staging, MANIFEST, config)
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS:
            raise
        raise _disk_full(ref, staging, 0, len(artifact.layers)) from None
    manifest = read_manifest(staging)  # the format and engine protocol versions, the schema
    require_trust(staging, manifest)   # every path inside the image, shm names plain
    require_safe_directory(manifest.control_dir, "the manifest's control_dir")  # as a restore will, before 20 GB
    match_manifest(artifact, manifest)
    return manifest, staging


class _Downloads:
    """The blobs of one pull: what the staging directory already holds, and the rest fetched.

    The files checked are recorded (host.verified) at most every RECORD_EVERY_S (_record) and once
    at the end, whatever happened: a record written after each blob made a pull quadratic in its layer
    count (4,000 one-byte layers: 277 s). A file checked but not yet recorded when a pull is killed
    is hashed again by the next one, and kept."""

    def __init__(self, staging: Path, entries: dict[str, FileEntry], layers: dict[str, Layer], reference: str,
                 parts: int = 1, progress: ByteProgress | None = None) -> None:
        self.staging, self.entries, self.layers, self.reference, self.parts = staging, entries, layers, reference, parts
        self._progress = progress
        self._lock = threading.Lock()
        self.checked: dict[str, tuple[os.stat_result, str]] = {}
        self._cancel = threading.Event()
        self._recorded_at, self._record_gap = time.monotonic(), RECORD_EVERY_S
        self.downloaded = self.reused = self.bytes_received = self.ranged = 0

    def run(self, client: Callable[[], RegistryClient], jobs: int) -> None:
        incoming = self.staging / INCOMING
        shutil.rmtree(incoming, ignore_errors=True)  # blobs in flight when a pull was interrupted
        missing = self._keep_what_is_there()
        os.mkdir(incoming, 0o700)
        order = sorted(missing, key=lambda rel: -self.entries[rel].size)
        if self._progress is not None:
            self._progress.expect(sum(self.layers[rel].size for rel in missing))
        try:
            parallel(lambda item: self._fetch(client, *item), list(enumerate(order)), jobs, self._cancel)
            self._settle()
        finally:
            with self._lock:
                self._record()
        os.rmdir(incoming)

    def _settle(self) -> None:
        """Wait (host.verified.wait_settled) until every file checked is old enough for the
        verified record to take it: the last files renamed into place, the weights file of many
        GB among them, would otherwise be left out of the final record and hashed again by the
        verify phase."""
        def stats() -> list[os.stat_result]:
            with self._lock:
                return [st for st, _ in self.checked.values()]

        verified.wait_settled(stats)

    def _record(self) -> None:
        """Write the verified record of what is checked so far (the caller holds the lock). The
        next write waits RECORD_EVERY_S, or ten times as long as this one took: writing a record
        of n files costs O(n), so the writes take at most a tenth of a pull, however many layers."""
        started = time.monotonic()
        verified.remember(self.staging, dict(self.checked))
        self._recorded_at = time.monotonic()
        self._record_gap = max(RECORD_EVERY_S, 10 * (self._recorded_at - started))

    def _keep_what_is_there(self) -> list[str]:
        """Files an interrupted pull renamed into place (so checked then) and still unchanged are
        kept; any other file found is hashed, kept if it matches, else removed."""
        self._remove_unlisted()
        record = verified.load(self.staging)
        missing: list[str] = []
        to_hash: dict[str, os.stat_result] = {}
        for rel, entry in self.entries.items():
            path = self.staging / rel
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                missing.append(rel)
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                self._remove(path, st)
                missing.append(rel)
            elif verified.still_verified(record, rel, st, entry.digest):
                self.checked[rel] = (st, entry.digest)
            else:
                to_hash[rel] = st
        # each by its entry's scheme: a model file's digest is its plain sha256 whatever its size (what
        # a restore compares), an image file's over one piece the digest of its 64 MiB pieces
        whole = [rel for rel in to_hash if self.entries[rel].scheme == "sha256" and to_hash[rel].st_size > PIECE]
        digests = piece_hashes(self.staging, {rel: st.st_size for rel, st in to_hash.items() if rel not in whole})
        with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
            digests.update(zip(whole, pool.map(lambda rel: sha256_file(self.staging / rel), whole)))
        for rel, st in to_hash.items():
            if digests[rel] == self.entries[rel].digest:
                self.checked[rel] = (st, digests[rel])
            else:
                self._remove(self.staging / rel, st)
                missing.append(rel)
        self.reused = len(self.checked)
        return missing

    def _remove_unlisted(self) -> None:
        """An adopted staging directory holds only what vsnap put there; drop what this manifest
        does not list (directories are walked, never followed)."""
        wanted = set(self.entries) | {MANIFEST}
        prefixes = {"/".join(rel.split("/")[:i]) for rel in self.entries for i in range(1, rel.count("/") + 1)}
        for dirpath, dirnames, filenames in os.walk(self.staging, followlinks=False):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                rel = str(path.relative_to(self.staging))
                st = os.lstat(path)
                if stat.S_ISDIR(st.st_mode) and rel in prefixes:
                    continue
                if rel not in wanted or not stat.S_ISREG(st.st_mode):
                    self._remove(path, st)
                    if name in dirnames:
                        dirnames.remove(name)

    def _remove(self, path: Path, st: os.stat_result) -> None:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)

    def _fetch(self, client: Callable[[], RegistryClient], index: int, rel: str) -> None:
        """One file into ``.incoming/<index>``, checked, then renamed into place and recorded (once,
        however many byte ranges it came in)."""
        layer: Layer = self.layers[rel]
        entry: FileEntry = self.entries[rel]
        part = self.staging / INCOMING / str(index)
        ranges = ranged.plan(layer, entry, self.parts)  # none for a file checked by its plain sha256
        in_ranges = False
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if ranges:
                in_ranges = ranged.fetch(client, layer, entry, fd, self.reference, ranges,
                                         checking(self._cancel, self._count), self._cancel)
            else:
                write_blob(client().blob_chunks(layer.digest), layer, entry, fd, self.reference,
                           checking(self._cancel, self._count))
            os.fsync(fd)
        finally:
            os.close(fd)
        self._make_parents(rel)
        os.rename(part, self.staging / rel)
        with self._lock:
            self.checked[rel] = (os.lstat(self.staging / rel), entry.digest)
            self.downloaded += 1
            self.ranged += in_ranges
            if time.monotonic() - self._recorded_at >= self._record_gap:
                self._record()
        failpoint("blob pulled")

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_received += nbytes
        if self._progress is not None:
            self._progress.add(nbytes)

    def _make_parents(self, rel: str) -> None:
        """The directories of ``rel`` inside the staging directory (private; a name already taken
        by a file is refused: two manifest entries cannot be a file and its directory)."""
        directory = self.staging
        for part in rel.split("/")[:-1]:
            directory = directory / part
            with self._lock:
                try:
                    os.mkdir(directory, 0o700)
                except FileExistsError:
                    if not stat.S_ISDIR(os.lstat(directory).st_mode):
                        raise ImageUntrusted(rel, "the artifact names a file and a directory of the same name",
                                             hint=ALTERED_HINT) from None
