"""The registry seam: oras-py speaks the OCI distribution protocol; vsnap adds what it lacks.

oras-py (``oras.provider.Registry``) gives the URLs of a repository's blobs, uploads and
manifests, the token and basic authentication flows, credential helpers, and the HEAD check for
a blob. Its bulk helpers do not fit a 20 GB image (``put_upload`` reads a whole blob into
memory, ``download_blob`` checks no digest and cannot resume), its ``do_request`` retries any
failure five times with sleeps of up to 83 s and sets no timeout, and it logs to stderr. So this
module builds on its lower layer: every request goes through oras' ``do_request`` (its
authentication retry) without oras' retry decorator, with a connect and read timeout and at most
three attempts for a request whose body can be sent again; uploads stream (a file, or zstd as it
is made) with the digest given at the end; reads are bounded. Every requests or oras failure
becomes a vsnap error here, once (exit 3: RegistryUnavailable; exit 4: ArtifactError).

Credentials come from the docker config (``$DOCKER_CONFIG/config.json``, else
``~/.docker/config.json``): an inline ``auth`` (or ``username``/``password``) for the registry,
or its credential helper (``credHelpers``, ``credsStore``) through oras.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import stat
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

from vsnap.host.trust import open_following_only_roots_links, require_trusted_ancestors
from vsnap.protocol.errors import ArtifactError, HostNotReady, ImageUntrusted, RegistryUnavailable, VsnapError

from .oci import OCI_MANIFEST, Reference

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0
MIN_BYTES_PER_S = 64 * 1024  # a transfer slower than this on average, after READ_TIMEOUT_S, is given up
ATTEMPTS = 3
MAX_CONFIG_BYTES = 1 << 20
MAX_ERROR_BYTES = 4096
READ_CHUNK = 4 << 20
LOGIN_HINT = "log in first (docker login REGISTRY writes ~/.docker/config.json; vsnap reads DOCKER_CONFIG too)"


def _oras() -> Any:
    try:
        import oras.provider
        import requests
    except ImportError:
        raise HostNotReady("oras", "vsnap push and pull need the oras package",
                           hint="pip install 'vsnap[registry]'") from None
    return oras, requests


def docker_config_path() -> Path | None:
    """Where docker (and so vsnap) reads registry credentials: $DOCKER_CONFIG/config.json, else
    ~/.docker/config.json; None if that file does not exist."""
    base = os.environ.get("DOCKER_CONFIG")
    path = Path(base) / "config.json" if base else Path.home() / ".docker" / "config.json"
    return path if os.path.lexists(path) else None


HELPER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
CONFIG_HINT = ("root runs the credential helpers a docker config names: keep it root's alone (chown root, chmod "
               "go-w, in root's directories), e.g. /root/.docker/config.json, or point DOCKER_CONFIG at one")


def read_docker_config(path: Path) -> dict[str, Any]:
    """The docker config as a dict; a file that is not a small regular JSON file is refused, and
    so is one that anyone but root could have written (it names programs root runs: credential
    helpers, ``docker-credential-<name>``), or that names a helper by anything but a plain name
    (a name with a ``/`` would run a path relative to the current directory)."""
    def untrusted(why: str) -> RegistryUnavailable:
        return RegistryUnavailable("", f"the docker config {path} {why}", hint=CONFIG_HINT)

    try:
        require_trusted_ancestors(Path(os.path.abspath(path)))
        fd = open_following_only_roots_links(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except ImageUntrusted as exc:
        raise untrusted(f"is not root's alone ({exc.path}: {exc.reason})") from None
    except OSError as exc:
        raise RegistryUnavailable("", f"cannot read the docker config {path}: {exc.strerror}",
                                  hint="fix or remove it, or point DOCKER_CONFIG at another directory") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid != os.geteuid():
            raise untrusted(f"is owned by uid {st.st_uid}, not by root")
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o022:
            raise untrusted(f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others can write it")
        data = os.read(fd, MAX_CONFIG_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
    finally:
        os.close(fd)
    try:
        config = json.loads(data) if 0 < len(data) <= MAX_CONFIG_BYTES else None
    except (ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        raise RegistryUnavailable("", f"the docker config {path} is not a JSON object of at most 1 MiB",
                                  hint="fix or remove it, or point DOCKER_CONFIG at another directory")
    helpers = config.get("credHelpers") or {}
    names = list(helpers.values()) if isinstance(helpers, dict) else [helpers]
    if config.get("credsStore"):
        names.append(config["credsStore"])
    for name in names:
        if not isinstance(name, str) or not HELPER_NAME.fullmatch(name):
            raise untrusted(f"names the credential helper {str(name)[:60]!r}; a helper is a plain name "
                            "(docker-credential-NAME on root's PATH)")
    return config


def inline_credentials(config: dict[str, Any], registry: str) -> tuple[str, str] | None:
    """The (user, password) the config's ``auths`` holds for ``registry`` (also under its
    https:// URL, and localhost for 127.0.0.1 and back), or None."""
    auths = config.get("auths")
    if not isinstance(auths, dict):
        return None
    names = [registry, f"https://{registry}", f"http://{registry}"]
    for a, b in (("127.0.0.1", "localhost"), ("localhost", "127.0.0.1")):
        if registry.startswith(a):
            names.append(b + registry[len(a):])
    for name in names:
        entry = auths.get(name)
        if not isinstance(entry, dict):
            continue
        if isinstance(entry.get("auth"), str) and entry["auth"]:
            try:
                user, _, password = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                raise RegistryUnavailable(registry, f"the docker config's auth for {name} is not base64 of "
                                                    "user:password", hint=LOGIN_HINT) from None
            return user, password
        if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
            return entry["username"], entry["password"]
    return None


def _error_text(response: Any) -> str:
    """The registry's own error message (OCI error JSON), bounded and on one line."""
    try:
        body = response.raw.read(MAX_ERROR_BYTES, decode_content=True) if response.raw is not None else b""
        errors = json.loads(body).get("errors") or []
        text = "; ".join(f"{e.get('code', '')}: {e.get('message', '')}" for e in errors if isinstance(e, dict))
    except Exception:  # any body at all: this is only the message
        text = ""
    return " ".join(text.split())[:300]


class RegistryClient:
    """One connection to one repository of one registry (a requests session: one per thread)."""

    def __init__(self, reference: Reference, *, insecure: bool = False) -> None:
        oras, requests = _oras()
        self.reference = reference
        self._requests = requests
        self.http = reference.loopback or insecure
        self.scheme = "http" if self.http else "https"
        _quiet_oras(oras)
        config_path = docker_config_path()
        config = read_docker_config(config_path) if config_path else {}
        credentials = inline_credentials(config, reference.registry)
        challenge = self._challenge(requests)
        backend = "basic" if challenge.lower().startswith("basic") else "token"
        if backend == "basic" and credentials is None:
            raise RegistryUnavailable(reference.registry, f"registry {reference.registry} asks for a login and the "
                                                          "docker config holds none for it", hint=LOGIN_HINT)
        self._registry = _registry_class(oras, requests)(hostname=reference.registry, insecure=self.http,
                                                          auth_backend=backend)
        _mount_timeouts(self._registry.session, requests)
        self._container = self._registry.get_container(f"{reference.registry}/x")
        self._container.registry, self._container.namespace = reference.registry, None
        self._container.repository = reference.repository
        self._container.tag, self._container.digest = reference.tag or "latest", reference.digest
        if credentials is not None:
            self._registry.auth.set_basic_auth(*credentials)
        elif config_path is not None and (config.get("credHelpers") or config.get("credsStore")):
            with self._translate("its credential helper"):  # runs docker-credential-NAME (a plain name)
                self._registry.auth.load_configs(self._container, configs=[str(config_path)])
        self._basic = backend == "basic"

    # --- plumbing -----------------------------------------------------------------------------

    def _challenge(self, requests: Any) -> str:
        """GET /v2/ unauthenticated: what kind of login the registry asks for ("" for none)."""
        url = f"{self.scheme}://{self.reference.registry}/v2/"
        with self._translate("GET /v2/"):
            response = requests.get(url, timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S), allow_redirects=False)
        response.close()
        if response.status_code == 200:
            return ""
        if response.status_code == 401:
            return response.headers.get("Www-Authenticate", "")
        raise RegistryUnavailable(self.reference.registry, f"{url} answered HTTP {response.status_code}; "
                                                           "is it an OCI registry?",
                                  hint="check the registry's address and port")

    @contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        """requests and oras failures -> vsnap errors (the one place they are caught)."""
        registry = self.reference.registry
        try:
            yield
        except VsnapError:
            raise
        except self._requests.exceptions.SSLError as exc:
            hint = ("a registry on 127.0.0.1 or localhost is spoken to over http; for another host without TLS "
                    "pass --insecure" if not self.http else "")
            raise RegistryUnavailable(registry, f"TLS with {registry} failed ({type(exc).__name__})",
                                      hint=hint or "check the registry's certificate") from None
        except self._requests.exceptions.Timeout:
            raise RegistryUnavailable(registry, f"registry {registry} did not answer {what} in time",
                                      hint="check the registry; run the command again to resume") from None
        except self._requests.exceptions.ConnectionError as exc:
            reason = str(exc.args[0] if exc.args else exc).rsplit(":", 1)[-1].strip(" )'\"")[:120]
            raise RegistryUnavailable(registry, f"cannot reach registry {registry} ({what}): {reason}",
                                      hint=f"is a registry listening on {self.scheme}://{registry}? "
                                           "run the command again to resume") from None
        except self._requests.exceptions.RequestException as exc:
            raise RegistryUnavailable(registry, f"{what} to {registry} failed: {type(exc).__name__}") from None
        except (KeyError, TypeError) as exc:  # oras: a credential helper's answer without Username/Secret
            raise RegistryUnavailable(registry, f"the credential helper for {registry} gave no usable login "
                                                f"({type(exc).__name__}: {str(exc)[:60]})", hint=LOGIN_HINT) from None
        except ValueError as exc:  # oras: "Cannot respond to request for authentication." and the like
            raise RegistryUnavailable(registry, f"registry {registry} refused {what}: {exc}", hint=LOGIN_HINT) from None

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = dict(extra or {})
        if self._basic:  # sent on every request: a streamed body cannot be sent twice after a 401
            headers.update(self._registry.auth.get_auth_header())
        return headers

    def _request(self, what: str, url: str, method: str, *, data: Any = None, headers: dict[str, str] | None = None,
                 stream: bool = False, ok: tuple[int, ...] = (200,)) -> Any:
        with self._translate(what):
            response = self._registry.do_request(url, method, data=data, headers=self._headers(headers), stream=stream)
        if response.status_code in ok:
            return response
        self._refuse(what, response)

    def _refuse(self, what: str, response: Any) -> None:
        code, detail = response.status_code, _error_text(response)
        response.close()
        registry, ref = self.reference.registry, str(self.reference)
        if code in (401, 403):
            raise RegistryUnavailable(registry, f"registry {registry} refused {what} for {self.reference.repository} "
                                                f"(HTTP {code}{': ' + detail if detail else ''})", hint=LOGIN_HINT)
        if code == 404 and what.startswith("GET manifest"):
            raise ArtifactError(ref, f"{ref} does not exist in the registry{': ' + detail if detail else ''}",
                                hint="check the repository and tag (vsnap push IMAGE REF puts one there)")
        raise RegistryUnavailable(registry, f"registry {registry} answered HTTP {code} to {what}"
                                            f"{': ' + detail if detail else ''}",
                                  hint="run the command again to resume; the registry's log may say more")

    def _url(self, path: str) -> str:
        return f"{self.scheme}://{path}"

    # --- blobs --------------------------------------------------------------------------------

    def blob_exists(self, digest: str) -> bool:
        url = self._url(self._container.get_blob_url(digest))
        response = self._request(f"HEAD blob {digest[:19]}", url, "HEAD", ok=(200, 404))
        response.close()
        return response.status_code == 200

    def _upload_location(self, response: Any) -> str:
        location = self._registry._get_location(response, self._container)
        response.close()
        if not location:
            raise RegistryUnavailable(self.reference.registry, f"registry {self.reference.registry} started an "
                                                               "upload without a Location")
        return location

    def upload_file(self, file: BinaryIO, size: int, digest: str) -> None:
        """A blob whose digest is known: POST, then one PUT streaming the file."""
        oras, _ = _oras()
        start = self._request("POST blob upload", self._url(self._container.upload_blob_url()), "POST",
                              headers={"Content-Length": "0"}, ok=(202,))
        url = oras.utils.append_url_params(self._upload_location(start), {"digest": digest})
        response = self._request(f"PUT blob {digest[:19]}", url, "PUT", data=file,
                                 headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
                                 ok=(201,))
        response.close()

    def upload_stream(self, chunks: Iterable[bytes], digest_of: Any) -> None:
        """A blob made as it is sent (zstd): POST, a streamed PATCH, then PUT with the digest
        ``digest_of()`` learned from the chunks."""
        oras, _ = _oras()
        start = self._request("POST blob upload", self._url(self._container.upload_blob_url()), "POST",
                              headers={"Content-Length": "0"}, ok=(202,))
        patched = self._request("PATCH blob data", self._upload_location(start), "PATCH", data=iter(chunks),
                                headers={"Content-Type": "application/octet-stream"}, ok=(202,))
        url = oras.utils.append_url_params(self._upload_location(patched), {"digest": digest_of()})
        response = self._request("PUT blob", url, "PUT", headers={"Content-Length": "0"}, ok=(201,))
        response.close()

    def blob_chunks(self, digest: str) -> Iterator[bytes]:
        """The blob's bytes as they arrive (the caller bounds and checks them)."""
        url = self._url(self._container.get_blob_url(digest))
        response = self._request(f"GET blob {digest[:19]}", url, "GET", stream=True, ok=(200,))
        try:
            with self._translate(f"GET blob {digest[:19]}"):
                yield from at_least_min_rate(response.iter_content(READ_CHUNK), self.reference.registry,
                                             f"blob {digest[:19]}")
        finally:
            response.close()

    def read_blob(self, digest: str, limit: int) -> bytes:
        data = bytearray()
        for chunk in self.blob_chunks(digest):
            data += chunk
            if len(data) > limit:
                raise ArtifactError(str(self.reference), f"{self.reference}: blob {digest[:19]}… runs past its "
                                                         f"{limit} bytes")
        return bytes(data)

    # --- manifests ----------------------------------------------------------------------------

    def get_manifest(self, limit: int) -> tuple[bytes, str]:
        """The manifest the reference names, at most ``limit`` bytes, and its Content-Type."""
        url = self._url(self._container.manifest_url())
        response = self._request(f"GET manifest {self.reference.target}", url, "GET", stream=True,
                                 headers={"Accept": OCI_MANIFEST})
        data = bytearray()
        try:
            with self._translate("GET manifest"):
                for chunk in at_least_min_rate(response.iter_content(64 << 10), self.reference.registry, "manifest"):
                    data += chunk
                    if len(data) > limit:
                        raise ArtifactError(str(self.reference), f"{self.reference}: the registry's manifest runs "
                                                                 f"past {limit >> 20} MiB; a vsnap image's is a few KB")
        finally:
            response.close()
        return bytes(data), response.headers.get("Content-Type", "").split(";")[0].strip()

    def put_manifest(self, data: bytes, tag: str) -> None:
        url = self._url(self._container.manifest_url(tag))
        response = self._request(f"PUT manifest {tag}", url, "PUT", data=data,
                                 headers={"Content-Type": OCI_MANIFEST}, ok=(201,))
        response.close()


_QUIETED = False


def _quiet_oras(oras: Any) -> None:
    """oras logs to stderr through its own logger; the library never prints."""
    global _QUIETED
    if not _QUIETED:
        oras.logger.logger.log_handler = []
        logging.getLogger("oras").propagate = False
        _QUIETED = True


def per_thread_clients(reference: Reference, *, insecure: bool = False) -> Callable[[], RegistryClient]:
    """A function that gives each thread its own RegistryClient of ``reference`` (a requests
    session is not shared between threads), made on its first call in that thread."""
    local = threading.local()

    def client() -> RegistryClient:
        if not hasattr(local, "client"):
            local.client = RegistryClient(reference, insecure=insecure)
        return local.client

    return client


def at_least_min_rate(chunks: Iterable[bytes], registry: str, what: str, *, grace_s: float = READ_TIMEOUT_S,
                      min_bytes_per_s: float = MIN_BYTES_PER_S,
                      clock: Callable[[], float] = time.monotonic) -> Iterator[bytes]:
    """``chunks`` as they arrive, ended with RegistryUnavailable once, after ``grace_s``, the
    transfer's average rate falls below ``min_bytes_per_s``: the read timeout alone lets a registry
    that sends a byte now and then hold a pull (a node's pre-pull loop) for ever."""
    start, received = clock(), 0
    for chunk in chunks:
        received += len(chunk)
        elapsed = clock() - start
        if elapsed > grace_s and received < min_bytes_per_s * elapsed:
            raise RegistryUnavailable(registry, f"{registry} sent {what} at {received / elapsed / 1024:.1f} KiB/s "
                                                f"after {elapsed:.0f} s; vsnap gives up below "
                                                f"{min_bytes_per_s / 1024:.0f} KiB/s",
                                      hint="check the registry and the network, then pull again (files already checked are kept)")
        yield chunk


def _mount_timeouts(session: Any, requests: Any) -> None:
    """Every request of the session gets a connect and read timeout (oras sets none)."""

    class TimeoutAdapter(requests.adapters.HTTPAdapter):
        def send(self, request: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)
            return super().send(request, **kwargs)

    for prefix in ("http://", "https://"):
        session.mount(prefix, TimeoutAdapter())


_REGISTRY_CLASS: Any = None


def _registry_class(oras: Any, requests: Any) -> Any:
    """oras' Registry whose do_request is oras' own minus its retry decorator, with a bounded retry
    of our own: connection failures and 502/503/504, only for bodies that can be sent again."""
    global _REGISTRY_CLASS
    if _REGISTRY_CLASS is not None:
        return _REGISTRY_CLASS
    undecorated = getattr(oras.provider.Registry.do_request, "__wrapped__", None)
    if undecorated is None:
        raise HostNotReady("oras", "this oras package's Registry.do_request has changed shape",
                           hint="pip install 'vsnap[registry]' (it pins the oras versions vsnap was tested with)")

    class Registry(oras.provider.Registry):  # type: ignore[misc,name-defined]
        def do_request(self, url: str, method: str = "GET", data: Any = None, headers: dict | None = None,
                       json: dict | None = None, stream: bool = False) -> Any:
            attempts = ATTEMPTS if data is None or isinstance(data, (bytes, dict)) else 1
            for attempt in range(attempts):
                try:
                    response = undecorated(self, url, method, data, headers, json, stream)
                except (requests.exceptions.ConnectionError, requests.exceptions.Timeout):
                    if attempt + 1 == attempts:
                        raise
                else:
                    if response.status_code not in (502, 503, 504) or attempt + 1 == attempts:
                        return response
                    response.close()
                time.sleep(0.5 * 2 ** attempt)
            raise AssertionError("unreachable")

    _REGISTRY_CLASS = Registry
    return Registry
