"""An image as an OCI artifact: references, media types, the manifest a push writes, and the
checks a pulled one must pass before any byte of it is written.

The layout (docs/image-format.md, "OCI layout"): one OCI image manifest whose ``artifactType``
is ARTIFACT_TYPE; its config blob is the image's manifest.json, byte for byte (so the pull knows
every file's size and digest before it fetches any); one layer per image file, titled with the
file's relative path: raw (FILE_MEDIA_TYPE) or zstd-compressed (FILE_ZSTD_MEDIA_TYPE, see
``encoding_for``). The weights file is a raw layer of its own, so images of one model share it.
An image pushed with its model (``vsnap push --model``) also has one raw layer per file of its
model directory (MODEL_FILE_MEDIA_TYPE), titled with the file's path inside that directory: its
blob is the file as it is, so every image of one model shares the model's blobs
(registry.model_files).

A registry is hostile input: ``parse_artifact`` bounds the document, checks its media types,
every digest's form and every size, and that each title is a plain relative path inside the
image; ``match_manifest`` checks the layers name exactly the files manifest.json lists.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vsnap.host.trust import require_inside
from vsnap.image.manifest import MANIFEST, MAX_MANIFEST_BYTES, WEIGHTS_DIR, Manifest
from vsnap.protocol.errors import ArtifactError, ImageUntrusted, UsageError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.vsnap.image.v1"
CONFIG_MEDIA_TYPE = "application/vnd.vsnap.image.manifest.v1+json"  # manifest.json itself
FILE_MEDIA_TYPE = "application/vnd.vsnap.image.file.v1"
FILE_ZSTD_MEDIA_TYPE = "application/vnd.vsnap.image.file.v1+zstd"
MODEL_FILE_MEDIA_TYPE = "application/vnd.vsnap.model.file.v1"  # a file of the image's model directory, raw
TITLE = "org.opencontainers.image.title"
ENCODINGS: dict[str, Literal["raw", "zstd"]] = {FILE_MEDIA_TYPE: "raw", FILE_ZSTD_MEDIA_TYPE: "zstd"}
MEDIA_TYPES = {encoding: media for media, encoding in ENCODINGS.items()}

MAX_OCI_MANIFEST_BYTES = 4 << 20   # an 8B image's manifest is a few KB; distribution's own limit is 4 MiB
MAX_LAYERS = 100_000
MAX_FILE_BYTES = 1 << 40           # one image file; the pull also checks the total against free disk
COMPRESS_MIN_BYTES = 64 << 10      # smaller files go raw: their blob digest is their manifest digest
INCOMING = ".incoming"             # the pull's directory for blobs in flight, inside its staging
MODEL_STAGING_PREFIX = ".vsnap-pull-"  # a pull stages model files in <model dir>/.vsnap-pull-<digest>
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


# --- references -------------------------------------------------------------------------------

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = re.compile(rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:]+\])(?::[0-9]{{1,5}})?")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
ALTERED_HINT = "the artifact in the registry was altered (or not made by vsnap push); nothing was written outside"
REFERENCE_HINT = ("write REGISTRY/REPOSITORY[:TAG] or REGISTRY/REPOSITORY@sha256:DIGEST, "
                  "e.g. 127.0.0.1:5000/vsnap/cpu-tiny:v1")


@dataclass(frozen=True)
class Reference:
    """``registry/repository[:tag][@digest]``; the registry is always named (vsnap never
    defaults to Docker Hub: an image holds process memory)."""

    registry: str          # host[:port]
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def host(self) -> str:
        return self.registry.rsplit(":", 1)[0] if not self.registry.endswith("]") else self.registry

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS

    @property
    def target(self) -> str:
        """What the manifest URL names: the digest if given, else the tag (default "latest")."""
        return self.digest or self.tag or "latest"

    @property
    def name(self) -> str:
        """The repository's last component: the default image directory name of a pull."""
        return self.repository.rsplit("/", 1)[-1]

    def with_digest(self, digest: str) -> "Reference":
        return Reference(self.registry, self.repository, self.tag, digest)

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse_reference(text: str) -> Reference:
    """Parse REF strictly (the OCI distribution spec's grammar); UsageError (exit 2) otherwise."""
    def refuse(why: str) -> UsageError:
        return UsageError(f"{text!r} is not an image reference: {why}", hint=REFERENCE_HINT)

    if len(text) > 1024 or not text.isprintable() or any(c.isspace() for c in text):
        raise refuse("too long, or it holds spaces or control characters")
    rest, digest = text, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not DIGEST.fullmatch(digest):
            raise refuse("a digest is sha256: and 64 lowercase hex digits")
    if "/" not in rest:
        raise refuse("name the registry first (REGISTRY/REPOSITORY)")
    registry, path = rest.split("/", 1)
    if not _HOST.fullmatch(registry) or not ("." in registry or ":" in registry or registry == "localhost"):
        raise refuse(f"{registry!r} is not a registry host (a name with a dot or a port, or localhost)")
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise refuse("a tag is up to 128 letters, digits, '.', '_' or '-', not starting with '.' or '-'")
    if not _REPOSITORY.fullmatch(path) or len(path) > 255:
        raise refuse("a repository is lowercase letters and digits separated by '/', '.', '_' or '-'")
    return Reference(registry, path, tag, digest)


# --- the layout ---------------------------------------------------------------------------------

def encoding_for(rel: str, size: int) -> Literal["raw", "zstd"]:
    """How a file travels: the weights file raw (its blob digest is then the file's own sha256,
    shared by every image of the model; weights gain little from zstd: docs/benchmarks/NOTES.md),
    small files raw (their blob digest is their manifest digest), everything else zstd (CRIU's
    pages are process memory: zeros, heaps, repeated structures)."""
    if rel.startswith(WEIGHTS_DIR + "/") or size < COMPRESS_MIN_BYTES:
        return "raw"
    return "zstd"


@dataclass(frozen=True)
class Layer:
    """One image file as one blob."""

    path: str                        # the file's path inside the image
    encoding: Literal["raw", "zstd"]
    digest: str                      # the blob's "sha256:..."
    size: int                        # the blob's bytes


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def build_manifest(config: bytes, layers: list[Layer], manifest: Manifest, model_layers: list[Layer] = ()) -> bytes:
    """The OCI image manifest a push writes (``config``: manifest.json's bytes). Layers are
    ordered by path, the image's files first, then the model's (``model_layers``, titled with
    their paths inside the model directory), so one image always gives the same document and the
    same digest."""
    document = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": sha256_digest(config), "size": len(config)},
        "layers": [{"mediaType": MEDIA_TYPES[layer.encoding], "digest": layer.digest, "size": layer.size,
                    "annotations": {TITLE: layer.path}} for layer in sorted(layers, key=lambda x: x.path)]
        + [{"mediaType": MODEL_FILE_MEDIA_TYPE, "digest": layer.digest, "size": layer.size,
            "annotations": {TITLE: layer.path}} for layer in sorted(model_layers, key=lambda x: x.path)],
        "annotations": {"org.opencontainers.image.created": manifest.created_at,
                        "dev.vsnap.image.name": manifest.name, "dev.vsnap.image.engine": manifest.engine,
                        "dev.vsnap.image.format": str(manifest.format_version),
                        "dev.vsnap.version": manifest.vsnap_version},
    }
    return json.dumps(document, indent=1, sort_keys=True).encode()


# --- what a pull accepts ---------------------------------------------------------------------------

class _Descriptor(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    mediaType: str = Field(max_length=255)
    digest: str = Field(max_length=100)
    size: int = Field(ge=0)
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64)


class _OciManifest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    schemaVersion: int
    mediaType: str | None = None
    artifactType: str | None = None
    config: _Descriptor
    layers: list[_Descriptor] = Field(max_length=MAX_LAYERS)


@dataclass(frozen=True)
class Artifact:
    """A pulled OCI manifest that passed ``parse_artifact``."""

    reference: Reference     # with the manifest's digest
    config_digest: str
    config_size: int
    layers: list[Layer]      # the image's files
    model_layers: list[Layer] = field(default_factory=list)  # its model's files (pushed with --model), raw


def parse_artifact(data: bytes, reference: Reference) -> Artifact:
    """Check an OCI manifest fetched for ``reference`` and return its layers. ArtifactError for a
    document that is too large, not JSON, not vsnap's artifact, or whose layers are malformed;
    ImageUntrusted for a title that would leave the image."""
    ref = str(reference)
    if len(data) > MAX_OCI_MANIFEST_BYTES:
        raise ArtifactError(ref, f"{ref}: the registry's manifest is over {MAX_OCI_MANIFEST_BYTES >> 20} MiB; "
                                 "a vsnap image's is a few KB")
    digest = sha256_digest(data)
    if reference.digest and digest != reference.digest:
        raise ArtifactError(ref, f"{ref}: the registry answered a manifest of digest {digest}",
                            hint="the registry is not serving what was pushed under that digest")
    try:
        oci = _OciManifest.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "document"
        raise ArtifactError(ref, f"{ref}: malformed OCI manifest ({where}: {first['msg']})") from None
    if oci.schemaVersion != 2 or oci.mediaType != OCI_MANIFEST:
        raise ArtifactError(ref, f"{ref} is not an OCI image manifest (schemaVersion {oci.schemaVersion}, "
                                 f"mediaType {oci.mediaType!r})", hint="is REF an image pushed by `vsnap push`?")
    if oci.artifactType != ARTIFACT_TYPE or oci.config.mediaType != CONFIG_MEDIA_TYPE:
        raise ArtifactError(ref, f"{ref} is not a vsnap image (artifactType {oci.artifactType!r}, "
                                 f"config {oci.config.mediaType!r}; vsnap pushes {ARTIFACT_TYPE})",
                            hint="is REF an image pushed by `vsnap push`?")
    _require_digest(ref, oci.config.digest, "config")
    if oci.config.size > MAX_MANIFEST_BYTES:
        raise ArtifactError(ref, f"{ref}: its manifest.json would be {oci.config.size} bytes; at most "
                                 f"{MAX_MANIFEST_BYTES} are read")
    layers: list[Layer] = []
    model_layers: list[Layer] = []
    for index, layer in enumerate(oci.layers):
        model = layer.mediaType == MODEL_FILE_MEDIA_TYPE
        encoding = "raw" if model else ENCODINGS.get(layer.mediaType)
        if encoding is None:
            raise ArtifactError(ref, f"{ref}: layer {index} has media type {layer.mediaType!r}; vsnap reads only "
                                     f"{FILE_MEDIA_TYPE}, {FILE_ZSTD_MEDIA_TYPE} and {MODEL_FILE_MEDIA_TYPE}")
        _require_digest(ref, layer.digest, f"layer {index}")
        path = layer.annotations.get(TITLE)
        if path is None:
            raise ArtifactError(ref, f"{ref}: layer {index} has no {TITLE} annotation naming its file")
        if model:
            require_model_path(path)
        else:
            require_image_path(path, "an artifact's layer title")
        if layer.size > MAX_FILE_BYTES:
            raise ArtifactError(ref, f"{ref}: layer {path} is {layer.size} bytes, over {MAX_FILE_BYTES}", file=path)
        (model_layers if model else layers).append(Layer(path, encoding, layer.digest, layer.size))
    for group in (layers, model_layers):  # titles name files of the image, or of the model directory
        _require_one_tree(ref, [layer.path for layer in group])
    return Artifact(reference.with_digest(digest), oci.config.digest, oci.config.size, layers, model_layers)


def _require_one_tree(ref: str, paths: list[str]) -> None:
    """Each path once, and none also a directory of another: checked before any blob, since
    downloads run side by side and a file and a directory of one name would otherwise meet only
    at a rename, in either order."""
    seen: set[str] = set()
    for path in paths:
        if path in seen:
            raise ArtifactError(ref, f"{ref}: two layers are titled {path}", file=path)
        seen.add(path)
    for path in seen:
        parents = path.split("/")[:-1]
        for depth in range(1, len(parents) + 1):
            if "/".join(parents[:depth]) in seen:
                raise ImageUntrusted(path, "the artifact names a file and a directory of the same name "
                                           f"({'/'.join(parents[:depth])})", hint=ALTERED_HINT)


def shown(path: str) -> str:
    """A path from an artifact or a manifest as a refusal names it: as it is if printable, else as
    Python escapes it (a newline or an escape sequence never splits or colours the one line)."""
    return path[:300] if path.isprintable() else ascii(path)[:300]


def _require_printable(path: str, what: str) -> None:
    if not path.isprintable():
        raise ImageUntrusted(shown(path), f"{what} holds a control character (only printable names are "
                                          "taken)", hint=ALTERED_HINT)


def require_model_path(path: str) -> str:
    """A model file's title: a plain relative path inside the model directory, not inside a
    directory vsnap stages in there (MODEL_STAGING_PREFIX), nor the staging's own INCOMING."""
    _require_printable(path, "an artifact's model file title")
    try:
        require_inside(path, "an artifact's model file title")
    except ImageUntrusted as exc:
        raise ImageUntrusted(exc.path, exc.reason, hint=ALTERED_HINT) from None
    first = path.split("/", 1)[0]
    if first.startswith(MODEL_STAGING_PREFIX) or first == INCOMING:  # INCOMING: a pull's blobs in flight
        raise ImageUntrusted(path, "a model file's title names a file vsnap writes itself", hint=ALTERED_HINT)
    return path


def require_image_path(path: str, what: str) -> str:
    """A path vsnap will create inside a pull's staging directory: plain, relative, inside, and
    neither manifest.json (that is the config blob) nor the pull's own INCOMING directory."""
    _require_printable(path, what)
    try:
        require_inside(path, what)
    except ImageUntrusted as exc:
        raise ImageUntrusted(exc.path, exc.reason, hint=ALTERED_HINT) from None
    if path == MANIFEST or path.split("/", 1)[0] == INCOMING:
        raise ImageUntrusted(path, f"{what} names a file vsnap writes itself", hint=ALTERED_HINT)
    return path


def _require_digest(ref: str, digest: str, what: str) -> None:
    if not DIGEST.fullmatch(digest):
        raise ArtifactError(ref, f"{ref}: {what} has digest {digest[:80]!r}; vsnap takes only sha256 digests")


def zstd_bound(size: int) -> int:
    """The most bytes zstd can make of ``size`` (ZSTD_COMPRESSBOUND, plus room for the frame)."""
    return size + (size >> 8) + (((128 << 10) - size) >> 11 if size < 128 << 10 else 0) + 1024


def match_manifest(artifact: Artifact, manifest: Manifest) -> None:
    """The layers are exactly the files manifest.json lists, each of a size that can hold it; the
    model layers, if any, exactly the model files it depends on, each that file's bytes."""
    ref = str(artifact.reference)
    if artifact.model_layers:
        _match_model(ref, artifact.model_layers, manifest)
    titles = {layer.path: layer for layer in artifact.layers}
    files = set(manifest.files)
    if MANIFEST in files:
        raise ImageUntrusted(MANIFEST, "manifest 'files' lists manifest.json itself", hint=ALTERED_HINT)
    missing, extra = sorted(files - set(titles)), sorted(set(titles) - files)
    if missing:
        raise ArtifactError(ref, f"{ref}: no layer holds {shown(missing[0])}, a file its manifest.json lists",
                            file=missing[0])
    if extra:
        raise ArtifactError(ref, f"{ref}: layer {shown(extra[0])} is not a file its manifest.json lists", file=extra[0])
    for path, layer in titles.items():
        entry = manifest.files[path]
        if entry.size > MAX_FILE_BYTES:
            raise ArtifactError(ref, f"{ref}: {path} would be {entry.size} bytes, over {MAX_FILE_BYTES}", file=path)
        if layer.encoding == "raw" and layer.size != entry.size:
            raise ArtifactError(ref, f"{ref}: layer {path} has {layer.size} bytes, its file {entry.size}", file=path)
        if layer.encoding == "raw" and entry.scheme == "sha256" and layer.digest != f"sha256:{entry.digest}":
            raise ArtifactError(ref, f"{ref}: layer {path} has digest {layer.digest}, its file sha256:{entry.digest}",
                                file=path)
        if layer.encoding == "zstd" and layer.size > zstd_bound(entry.size):
            raise ArtifactError(ref, f"{ref}: layer {path} has {layer.size} bytes, more than zstd makes of its "
                                     f"{entry.size}-byte file", file=path)


def _match_model(ref: str, layers: list[Layer], manifest: Manifest) -> None:
    """A model layer's blob is one model file as it is: same path in the model directory, same
    size, its sha256 the blob's digest. All of them or none (a pull would place half a model)."""
    wanted = manifest.model_files()
    titles = {layer.path: layer for layer in layers}
    missing, extra = sorted(set(wanted) - set(titles)), sorted(set(titles) - set(wanted))
    if extra:
        raise ArtifactError(ref, f"{ref}: model layer {shown(extra[0])} is not a file of the model its manifest.json "
                                 f"depends on ({shown(manifest.launch.model)})", file=extra[0], hint=ALTERED_HINT)
    if missing:
        raise ArtifactError(ref, f"{ref}: no model layer holds {shown(missing[0])}, a file of its model "
                                 f"({len(titles)} of {len(wanted)} are there)", file=missing[0], hint=ALTERED_HINT)
    for path, layer in titles.items():
        dep = wanted[path]
        if dep.sha256 is None or layer.size != dep.size or layer.digest != f"sha256:{dep.sha256}":
            raise ArtifactError(ref, f"{ref}: model layer {path} ({layer.size} bytes, {layer.digest[:19]}…) is not "
                                     f"the file manifest.json records", file=path, hint=ALTERED_HINT)
