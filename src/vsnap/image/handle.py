"""The image object: one open image, trust-checked, read-locked, its manifest read once.

Before it, each use case derived its own pieces from a bare path (the owner check, the lock, the
manifest, the digest, the shm and CRIU directories): a restore passed one path through 17 stops
in 10 modules under 20 names. Now a use case opens the image once and asks the handle:

    with open_image(path) as image:        # trust model, readers' lock, manifest.json read once
        image.verify_files(...)             # every file against the manifest (cached per host)
        image.require_fits_host(...)        # every recorded fact against this host
        CriuRunner(...).restore(image.criu_dir, ...)
        image.release()                     # the engine has read what it needs: captures may go on

The readers' lock is what keeps a capture from replacing the image while it is read; it is held
from open until ``release()`` or the end of the ``with`` block, whichever comes first.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType

from vsnap.host.facts import HostFacts
from vsnap.host.trust import require_trusted_tree
from vsnap.host.verified import VERIFIED_DIR

from . import compat, store
from .manifest import CRIU_DIR, ENGINE_LOG, SHM_DIR, WEIGHTS_DIR, Manifest, read_manifest
from .origin import manifest_sha256


class Image:
    """An image opened by ``open_image``: its path, its manifest, and the lock it holds."""

    def __init__(self, path: Path, manifest: Manifest, held: ExitStack) -> None:
        self.path = path
        self.manifest = manifest
        self._held = held

    @property
    def criu_dir(self) -> Path:
        return self.path / CRIU_DIR

    @property
    def weights_dir(self) -> Path:
        return self.path / WEIGHTS_DIR

    @property
    def shm_dir(self) -> Path:
        return self.path / SHM_DIR

    @property
    def engine_log(self) -> Path:
        return self.path / ENGINE_LOG

    @property
    def digest(self) -> str:
        """What tells one capture from another at the same path (a standby records it, its
        activation checks it): sha256 of manifest.json's bytes, which no vsnap version reads
        differently. ``manifest_digest`` (of the parsed manifest) changed whenever a vsnap version
        added a field with a default, so standbys failed to activate after an upgrade."""
        return manifest_sha256(self.path) or manifest_digest(self.manifest)

    def is_capture_of(self, recorded_digest: str | None) -> bool:
        """Is this the capture a record names by digest (either scheme: standbys recorded before
        ``digest`` carry ``manifest_digest``)?"""
        return recorded_digest in (self.digest, manifest_digest(self.manifest))

    def verify_files(self, *, rehash: bool = False, cache_root: Path | None = VERIFIED_DIR) -> list[str]:
        """Every file the manifest lists, checked (store.verify_files); returns those hashed now."""
        return store.verify_files(self.path, self.manifest, cache_root=cache_root, rehash=rehash)

    def require_fits_host(self, current: HostFacts | Future[HostFacts] | None = None, *,
                          cache_root: Path | None = VERIFIED_DIR) -> list[compat.HostDifference]:
        """Refuse a host this image cannot be restored on (compat.require_host_matches); return the
        differences that do not stop a restore."""
        return compat.require_host_matches(self.manifest, current, cache_root=cache_root)

    def release(self) -> None:
        """Let captures replace the image (the readers' lock goes); idempotent."""
        self._held.close()

    def __enter__(self) -> Image:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def open_image(path: Path | str, *, trusted: bool = True, lock: bool = True) -> Image:
    """Open the image at ``path``: the trust model first (root's alone, before a byte of it is
    read), then the readers' lock (``lock``; ImageBusy while a capture replaces it), then
    manifest.json (format and protocol versions first). Refused with the typed image errors.

    ``trusted=False, lock=False`` only shows what an image says (`vsnap inspect`): its manifest is
    read without following another user's link, and nothing of it is acted on."""
    image_dir = Path(path).absolute()
    if trusted:
        require_trusted_tree(image_dir)
    held = ExitStack()
    try:
        if lock:
            if not store.is_vsnap_image(image_dir):
                read_manifest(image_dir)  # refuses it, before a lock file is made beside a directory that is no image
            held.enter_context(store.image_read_lock(image_dir))
        manifest = read_manifest(image_dir)
    except BaseException:
        held.close()
        raise
    return Image(image_dir, manifest, held)


def manifest_digest(manifest: Manifest) -> str:
    """sha256 of the manifest as this vsnap parses it: what standbys recorded before Image.digest."""
    return hashlib.sha256(manifest.model_dump_json().encode()).hexdigest()
