"""The registry seam: oras-py speaks the OCI distribution protocol; vsnap adds what it lacks.

oras-py (``oras.provider.Registry``) gives the URLs of a repository's blobs, uploads and
manifests, an upload's Location, and credential helpers. Its bulk helpers do not fit a 20 GB
image (``put_upload`` reads a whole blob into memory, ``download_blob`` checks no digest and cannot
resume), and its ``do_request`` cannot be bounded: requests follows redirects reading their bodies
whole, its token flow reads the token service's answer whole and sends the docker config's
credentials to whatever service a 401 names, on any host, over plain http. So the requests are
vsnap's own (registry.transport: every body bounded before it is buffered or decoded, every
exchange under a deadline a drip cannot extend): the Basic and token logins, redirects (followed
without reading their bodies, credentials never to another origin), at most three attempts for a
request whose body can be sent again; uploads stream (a file, or zstd as it is made) with the
digest given at the end. Every requests, urllib3 or oras failure becomes a vsnap error here, once
(exit 3: RegistryUnavailable; exit 4: ArtifactError).

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
from urllib.parse import urljoin, urlsplit

from vsnap.host.trust import open_following_only_roots_links, require_trusted_ancestors
from vsnap.protocol.errors import ArtifactError, HostNotReady, ImageUntrusted, RegistryUnavailable, VsnapError

from .oci import OCI_MANIFEST, Reference
from .transport import (
    _CURRENT,
    MIN_BYTES_PER_S,
    RAW_CHUNK,
    READ_TIMEOUT_S,
    Expired,
    Transfer,
    body,
    counted,
    new_session,
    read_body,
)

ATTEMPTS = 3
MAX_CONFIG_BYTES = 1 << 20
MAX_ERROR_BYTES = 4096
MAX_TOKEN_BYTES = 256 << 10  # a token service's JSON answer (a JWT is a few KB)
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
FOREIGN_AUTH_ENV = "VSNAP_ALLOW_FOREIGN_AUTH"
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


def _origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of ``url``: where a credential may go (a malformed or ambiguous URL: no
    origin, so nothing is sent there and a redirect, realm or upload there is refused)."""
    if not unambiguous_url(url):
        return "", "", 0
    try:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        return scheme, (parts.hostname or "").lower(), parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        return "", "", 0


AMBIGUOUS = "a URL that HTTP libraries read differently (a backslash, a user name, spaces or control characters)"


def unambiguous_url(url: str) -> bool:
    """Whether every parser reads the same host in ``url``: urllib's urlsplit (which decides where
    credentials may go) and urllib3's parse_url (which opens the connection) disagree on a backslash
    (``http://evil\\@registry/`` is registry to one, evil to the other); userinfo, whitespace and
    control characters have no place in a registry's URLs either."""
    if not url.isascii() or not url.isprintable() or any(c in url for c in "\\ "):
        return False
    try:
        from urllib3.util import parse_url

        ours, theirs = urlsplit(url), parse_url(url)
        if ours.username is not None or theirs.auth is not None:
            return False
        return ((ours.hostname or "").lower(), ours.port) == ((theirs.host or "").lower().strip("[]"), theirs.port)
    except Exception:  # a URL either parser refuses (ValueError, urllib3's LocationParseError)
        return False


def _challenge_params(header: str) -> dict[str, str]:
    """The key="value" pairs of a Www-Authenticate header (realm, service, scope)."""
    return {key.lower(): value for key, value in re.findall(r'([A-Za-z]+)="([^"]*)"', header[:8192])}


def _error_text(response: Any, transfer: Transfer) -> str:
    """The registry's own error message (OCI error JSON), bounded and on one line."""
    try:
        data = read_body(response, transfer, lambda why: ValueError(why), MAX_ERROR_BYTES,
                         lambda: ValueError("long"))
        errors = json.loads(data).get("errors") or []
        text = "; ".join(f"{e.get('code', '')}: {e.get('message', '')}" for e in errors if isinstance(e, dict))
    except Exception:  # any body at all: this is only the message
        text = ""
    return " ".join(text.split())[:300]


class RegistryClient:
    """One connection to one repository of one registry (a requests session: one per thread).

    Credentials (the docker config's, as Basic, or the bearer token a token service gave for
    them) go only to the registry's own origin (scheme, host, port): never with a redirect or an
    upload Location elsewhere, and to a token service on another origin only over https and only
    where ``VSNAP_ALLOW_FOREIGN_AUTH`` names its host (_require_realm_may_have)."""

    def __init__(self, reference: Reference, *, insecure: bool = False) -> None:
        oras, requests = _oras()
        self.reference = reference
        self._requests = requests
        self.http = reference.loopback or insecure
        self.scheme = "http" if self.http else "https"
        self.origin = _origin(f"{self.scheme}://{reference.registry}/")
        _quiet_oras(oras)
        self.session = new_session(requests)
        config_path = docker_config_path()
        config = read_docker_config(config_path) if config_path else {}
        challenge = self._challenge()
        self._basic = challenge.lower().startswith("basic")
        self._token: str | None = None
        self._registry = oras.provider.Registry(hostname=reference.registry, insecure=self.http, auth_backend="basic")
        self._container = self._registry.get_container(f"{reference.registry}/x")
        self._container.registry, self._container.namespace = reference.registry, None
        self._container.repository = reference.repository
        self._container.tag, self._container.digest = reference.tag or "latest", reference.digest
        self._basic_auth = self._credentials(config, config_path)
        if self._basic and self._basic_auth is None:
            raise RegistryUnavailable(reference.registry, f"registry {reference.registry} asks for a login and the "
                                                          "docker config holds none for it", hint=LOGIN_HINT)

    def _credentials(self, config: dict[str, Any], config_path: Path | None) -> str | None:
        """base64 of user:password for this registry: the config's inline auth, else its credential helper's."""
        credentials = inline_credentials(config, self.reference.registry)
        if credentials is not None:
            return base64.b64encode(f"{credentials[0]}:{credentials[1]}".encode()).decode()
        if config_path is not None and (config.get("credHelpers") or config.get("credsStore")):
            with self._translate("its credential helper"):  # runs docker-credential-NAME (a plain name)
                self._registry.auth.load_configs(self._container, configs=[str(config_path)])
            found = getattr(self._registry.auth, "_basic_auth", None)
            return found if isinstance(found, str) and found else None
        return None

    # --- plumbing -----------------------------------------------------------------------------

    def _challenge(self) -> str:
        """GET /v2/ unauthenticated: what kind of login the registry asks for ("" for none). Its
        body is never read."""
        url = f"{self.scheme}://{self.reference.registry}/v2/"
        with self._exchange("GET /v2/", url, "GET", ok=(200, 401), plain=True) as response:
            if response.status_code == 401:
                return str(response.headers.get("Www-Authenticate", ""))[:8192]
        return ""

    @contextmanager
    def _exchange(self, what: str, url: str, method: str, *, data: Any = None, headers: dict[str, str] | None = None,
                  ok: tuple[int, ...] = (200,), plain: bool = False) -> Iterator[Any]:
        """One request and its answer under one Transfer (its deadline): the response, whose status
        is in ``ok`` (else the refusal), for the block to read with ``self.body``; closed after.
        ``plain``: no login, no redirect, no retry (the challenge)."""
        transfer = Transfer()
        response = None
        try:
            with transfer.current(), self._translate(what, transfer):
                if plain:
                    response = self.session.request(method, url, stream=True, allow_redirects=False)
                else:
                    response = self._open(what, url, method, data, headers or {}, transfer)
                if response.status_code not in ok:
                    self._refuse(what, response, transfer)
                yield response
                if transfer.expired:
                    raise Expired()
        finally:
            if response is not None:
                response.close()
            transfer.close()

    def body(self, response: Any, what: str, *, limit: int | None = None,
             too_long: Callable[[], Exception] | None = None, piece: int = RAW_CHUNK) -> Iterator[bytes]:
        """The body of an ``_exchange``'s response, decoded, bounded (transport.body)."""
        transfer = getattr(_CURRENT, "transfer", None)
        assert transfer is not None, "read a body inside its _exchange"
        return body(response, transfer, self._bad_body(what), limit=limit, too_long=too_long, piece=piece)

    def _bad_body(self, what: str) -> Callable[[str], Exception]:
        registry = self.reference.registry
        return lambda why: RegistryUnavailable(registry, f"registry {registry} answered {what} with {why}",
                                               hint="check the registry (or the proxy before it)")

    def _open(self, what: str, url: str, method: str, data: Any, headers: dict[str, str], transfer: Transfer) -> Any:
        """The request sent (logged in, redirects followed): at most ATTEMPTS times for connection
        failures and 502/503/504, only for a body that can be sent again; never after the deadline."""
        resendable = data is None or isinstance(data, bytes)
        attempts = ATTEMPTS if resendable else 1
        for attempt in range(attempts):
            last = attempt + 1 == attempts
            try:
                response = self._follow(what, url, method, counted(data, transfer), headers, transfer, resendable)
            except (self._requests.exceptions.ConnectionError, self._requests.exceptions.Timeout):
                if last or transfer.expired:
                    raise
            else:
                if response.status_code not in (502, 503, 504) or last:
                    return response
                response.close()
            time.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable")

    def _follow(self, what: str, url: str, method: str, data: Any, headers: dict[str, str], transfer: Transfer,
                resendable: bool) -> Any:
        """One attempt: a 401 naming a token service gets a token (once) and the request again; a
        redirect of a GET or HEAD is followed (at most MAX_REDIRECTS, its body never read)."""
        logged_in = False
        for _ in range(MAX_REDIRECTS + 2):
            response = self._send(method, url, data, headers)
            challenge = str(response.headers.get("Www-Authenticate", ""))
            if response.status_code == 401 and not logged_in and challenge.lower().startswith("bearer"):
                response.close()
                if not resendable:
                    raise RegistryUnavailable(self.reference.registry, f"registry {self.reference.registry} asked "
                                                                       f"for a login in the middle of {what}",
                                              hint="run the command again")
                self._token, logged_in = self._fetch_token(challenge, transfer), True
                continue
            if response.status_code in REDIRECTS and method in ("GET", "HEAD"):
                location = str(response.headers.get("Location", ""))
                response.close()
                url = self._redirect_target(url, location, what)
                continue
            return response
        raise RegistryUnavailable(self.reference.registry, f"registry {self.reference.registry} redirected {what} "
                                                           f"more than {MAX_REDIRECTS} times",
                                  hint="check the registry's address")

    def _send(self, method: str, url: str, data: Any, headers: dict[str, str]) -> Any:
        """One HTTP exchange, streamed, no redirect followed; Authorization only to the registry's origin."""
        headers = dict(headers)
        if _origin(url) == self.origin:
            if self._token:
                headers["Authorization"] = f"Bearer {self._token}"
            elif self._basic and self._basic_auth:
                headers["Authorization"] = f"Basic {self._basic_auth}"
        return self.session.request(method, url, data=data, headers=headers, stream=True, allow_redirects=False)

    def _redirect_target(self, url: str, location: str, what: str) -> str:
        target = urljoin(url, location[:8192])
        if not unambiguous_url(target):
            raise RegistryUnavailable(self.reference.registry, f"registry {self.reference.registry} redirected "
                                                               f"{what} to {target[:120]!r}, {AMBIGUOUS}; refused",
                                      hint="check the registry's storage redirect settings")
        scheme = _origin(target)[0]
        if scheme not in ("http", "https") or (scheme == "http" and not self.http):
            raise RegistryUnavailable(self.reference.registry, f"registry {self.reference.registry} redirected "
                                                               f"{what} to {target[:120]!r}; vsnap follows https only "
                                                               "(http for a loopback or --insecure registry)",
                                      hint="check the registry's storage redirect settings")
        return target

    def _fetch_token(self, challenge: str, transfer: Transfer) -> str:
        """A bearer token from the token service the challenge names (its answer bounded)."""
        registry = self.reference.registry
        params = _challenge_params(challenge)
        realm = params.get("realm", "")
        if realm and not unambiguous_url(realm):
            raise RegistryUnavailable(registry, f"registry {registry} names the token service {realm[:120]!r}, "
                                                f"{AMBIGUOUS}; refused", hint="check the registry's auth settings")
        if _origin(realm)[0] not in ("http", "https"):
            raise RegistryUnavailable(registry, f"registry {registry} asks for a token but names no token service "
                                                "URL", hint="check the registry's auth settings")
        headers = {"Accept": "application/json"}
        if self._basic_auth:
            self._require_realm_may_have(realm)
            headers["Authorization"] = f"Basic {self._basic_auth}"
        query = {key: params[key] for key in ("service", "scope") if params.get(key)}
        response = self.session.get(realm, params=query, headers=headers, stream=True, allow_redirects=False)
        try:
            if response.status_code != 200:
                raise RegistryUnavailable(registry, f"the token service {realm[:120]} of {registry} answered HTTP "
                                                    f"{response.status_code}", hint=LOGIN_HINT)
            data = read_body(response, transfer, self._bad_body("a token"), MAX_TOKEN_BYTES)
        finally:
            response.close()
        return self._token_of(data, realm)

    def _token_of(self, data: bytes, realm: str) -> str:
        try:
            document = json.loads(data)
            token = document.get("token") or document.get("access_token")
        except (ValueError, RecursionError, AttributeError):
            token = None
        if not isinstance(token, str) or not token or not token.isascii() or not token.isprintable():
            raise RegistryUnavailable(self.reference.registry, f"the token service {realm[:120]} gave no token",
                                      hint=LOGIN_HINT)
        return token

    def _require_realm_may_have(self, realm: str) -> None:
        """The docker config's credentials for this registry go to a token service on another
        origin only over https, and only where VSNAP_ALLOW_FOREIGN_AUTH names its host (or host:port)."""
        scheme, host, port = _origin(realm)
        if (scheme, host, port) == self.origin:
            return
        allowed = {name.strip().lower() for name in os.environ.get(FOREIGN_AUTH_ENV, "").split(",") if name.strip()}
        if scheme == "https" and (host in allowed or f"{host}:{port}" in allowed):
            return
        registry = self.reference.registry
        if scheme != "https":
            raise RegistryUnavailable(registry, f"registry {registry} asks vsnap to send its login to "
                                                f"{scheme}://{host}:{port}, another origin over plain http; refused",
                                      hint="a token service on another origin gets credentials only over https")
        raise RegistryUnavailable(registry, f"registry {registry} asks vsnap to send its login to the token service "
                                            f"{host}:{port}, another origin; refused",
                                  hint=f"if that service is trusted with the login for {registry}: "
                                       f"export {FOREIGN_AUTH_ENV}={host}")

    @contextmanager
    def _translate(self, what: str, transfer: Transfer | None = None) -> Iterator[None]:
        """requests, urllib3 and oras failures -> vsnap errors (the one place they are caught); any
        failure once the deadline passed is the deadline's."""
        try:
            yield
        except Expired:
            assert transfer is not None
            raise transfer.refusal(self.reference.registry, what) from None
        except VsnapError:
            raise
        except Exception as exc:
            if transfer is not None and transfer.expired:
                raise transfer.refusal(self.reference.registry, what) from None
            translated = self._translated(exc, what)
            if translated is None:
                raise
            raise translated from None

    def _translated(self, exc: Exception, what: str) -> VsnapError | None:
        registry, exceptions = self.reference.registry, self._requests.exceptions
        import urllib3.exceptions as u3

        if isinstance(exc, (exceptions.SSLError, u3.SSLError)):
            hint = ("a registry on 127.0.0.1 or localhost is spoken to over http; for another host without TLS "
                    "pass --insecure" if not self.http else "")
            return RegistryUnavailable(registry, f"TLS with {registry} failed ({type(exc).__name__})",
                                       hint=hint or "check the registry's certificate")
        if isinstance(exc, (exceptions.Timeout, u3.TimeoutError)):
            return RegistryUnavailable(registry, f"registry {registry} did not answer {what} in time",
                                       hint="check the registry; run the command again to resume")
        if isinstance(exc, exceptions.ConnectionError):
            reason = str(exc.args[0] if exc.args else exc).rsplit(":", 1)[-1].strip(" )'\"")[:120]
            return RegistryUnavailable(registry, f"cannot reach registry {registry} ({what}): {reason}",
                                       hint=f"is a registry listening on {self.scheme}://{registry}? "
                                            "run the command again to resume")
        if isinstance(exc, (exceptions.RequestException, u3.HTTPError, ConnectionError)):
            return RegistryUnavailable(registry, f"{what} to {registry} failed: {type(exc).__name__}",
                                       hint="run the command again to resume")
        if isinstance(exc, (KeyError, TypeError)):  # oras: a credential helper's answer without Username/Secret
            return RegistryUnavailable(registry, f"the credential helper for {registry} gave no usable login "
                                                 f"({type(exc).__name__}: {str(exc)[:60]})", hint=LOGIN_HINT)
        if isinstance(exc, ValueError) and not isinstance(exc, UnicodeError):
            return RegistryUnavailable(registry, f"registry {registry} refused {what}: {str(exc)[:200]}",
                                       hint=LOGIN_HINT)
        return None

    def _refuse(self, what: str, response: Any, transfer: Transfer) -> None:
        code, detail = response.status_code, _error_text(response, transfer)
        response.close()
        registry, ref = self.reference.registry, str(self.reference)
        if code in (401, 403):
            raise RegistryUnavailable(registry, f"registry {registry} refused {what} for {self.reference.repository} "
                                                f"(HTTP {code}{': ' + detail if detail else ''})", hint=LOGIN_HINT)
        if code == 404 and what.startswith("GET manifest"):
            raise ArtifactError(ref, f"{ref} does not exist in the registry{': ' + detail if detail else ''}",
                                hint="check the repository and tag (vsnap push IMAGE REF puts one there)")
        if what == "GET /v2/":
            raise RegistryUnavailable(registry, f"{self.scheme}://{registry}/v2/ answered HTTP {code}; is it an OCI "
                                                "registry?", hint="check the registry's address and port")
        raise RegistryUnavailable(registry, f"registry {registry} answered HTTP {code} to {what}"
                                            f"{': ' + detail if detail else ''}",
                                  hint="run the command again to resume; the registry's log may say more")

    def _url(self, path: str) -> str:
        return f"{self.scheme}://{path}"

    # --- blobs --------------------------------------------------------------------------------

    def blob_exists(self, digest: str) -> bool:
        url = self._url(self._container.get_blob_url(digest))
        with self._exchange(f"HEAD blob {digest[:19]}", url, "HEAD", ok=(200, 404)) as response:
            return bool(response.status_code == 200)

    def _upload_location(self, response: Any) -> str:
        """Where the upload goes on (absolute). One on another origin is used, with no credentials (_send)."""
        location = str(self._registry._get_location(response, self._container))[:8192]
        if not location:
            raise RegistryUnavailable(self.reference.registry, f"registry {self.reference.registry} started an "
                                                               "upload without a Location")
        if not unambiguous_url(location):
            raise RegistryUnavailable(self.reference.registry, f"registry {self.reference.registry} sent an upload "
                                                               f"to {location[:120]!r}, {AMBIGUOUS}; refused")
        if _origin(location)[0] not in ("http", "https") or (_origin(location)[0] == "http" and not self.http):
            raise RegistryUnavailable(self.reference.registry, f"registry {self.reference.registry} sent an upload "
                                                               f"to {location[:120]!r}; vsnap sends https only (http "
                                                               "for a loopback or --insecure registry)")
        return location

    def _start_upload(self) -> str:
        with self._exchange("POST blob upload", self._url(self._container.upload_blob_url()), "POST",
                            headers={"Content-Length": "0"}, ok=(202,)) as start:
            return self._upload_location(start)

    def upload_file(self, file: BinaryIO, size: int, digest: str) -> None:
        """A blob whose digest is known: POST, then one PUT streaming the file."""
        oras, _ = _oras()
        url = oras.utils.append_url_params(self._start_upload(), {"digest": digest})
        with self._exchange(f"PUT blob {digest[:19]}", url, "PUT", data=file, ok=(201,),
                            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)}):
            pass

    def upload_stream(self, chunks: Iterable[bytes], digest_of: Any) -> None:
        """A blob made as it is sent (zstd): POST, a streamed PATCH, then PUT with the digest
        ``digest_of()`` learned from the chunks."""
        oras, _ = _oras()
        location = self._start_upload()
        with self._exchange("PATCH blob data", location, "PATCH", data=iter(chunks), ok=(202,),
                            headers={"Content-Type": "application/octet-stream"}) as patched:
            location = self._upload_location(patched)
        url = oras.utils.append_url_params(location, {"digest": digest_of()})
        with self._exchange("PUT blob", url, "PUT", headers={"Content-Length": "0"}, ok=(201,)):
            pass

    def blob_chunks(self, digest: str) -> Iterator[bytes]:
        """The blob's bytes as they arrive (the caller bounds and checks them)."""
        url = self._url(self._container.get_blob_url(digest))
        what = f"GET blob {digest[:19]}"
        with self._exchange(what, url, "GET", ok=(200,)) as response:
            yield from self.body(response, what)

    @contextmanager
    def blob_range(self, digest: str, start: int, end: int) -> Iterator[Any]:
        """GET bytes ``start`` to ``end`` (inclusive, as ``Range: bytes=start-end`` writes them) of
        a blob, logged in and redirected as any GET (the Range header travels with a redirect to
        storage, credentials only to the registry's origin): the response, 200 (the registry
        ignored the range: the whole blob follows) or 206, for the block to check (its
        Content-Range: registry.ranged) and read with ``self.body``, under its own deadline."""
        url = self._url(self._container.get_blob_url(digest))
        with self._exchange(range_what(digest, start, end), url, "GET", headers={"Range": f"bytes={start}-{end}"},
                            ok=(200, 206)) as response:
            yield response

    def read_blob(self, digest: str, limit: int) -> bytes:
        def too_long() -> ArtifactError:
            return ArtifactError(str(self.reference), f"{self.reference}: blob {digest[:19]}… runs past its "
                                                      f"{limit} bytes")
        url, what = self._url(self._container.get_blob_url(digest)), f"GET blob {digest[:19]}"
        with self._exchange(what, url, "GET", ok=(200,)) as response:
            return b"".join(self.body(response, what, limit=limit, too_long=too_long))

    # --- manifests ----------------------------------------------------------------------------

    def get_manifest(self, limit: int) -> tuple[bytes, str]:
        """The manifest the reference names, at most ``limit`` bytes, and its Content-Type."""
        def too_long() -> ArtifactError:
            return ArtifactError(str(self.reference), f"{self.reference}: the registry's manifest runs past "
                                                      f"{limit >> 20} MiB; a vsnap image's is a few KB")
        url = self._url(self._container.manifest_url())
        with self._exchange(f"GET manifest {self.reference.target}", url, "GET",
                            headers={"Accept": OCI_MANIFEST}) as response:
            data = b"".join(self.body(response, "GET manifest", limit=limit, too_long=too_long))
            content_type = str(response.headers.get("Content-Type", "")).split(";")[0].strip()
        return data, content_type

    def put_manifest(self, data: bytes, tag: str) -> None:
        url = self._url(self._container.manifest_url(tag))
        with self._exchange(f"PUT manifest {tag}", url, "PUT", data=data, headers={"Content-Type": OCI_MANIFEST},
                            ok=(201,)):
            pass


def range_what(digest: str, start: int, end: int) -> str:
    """How a ranged GET is named in messages."""
    return f"GET blob {digest[:19]} bytes {start}-{end}"


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
    that sends a byte now and then hold a pull (a node's pre-pull loop) for ever. The rule as a
    filter over chunks, with an injectable clock (tests/unit/test_oci.py); the requests themselves
    are held to it by transport.Transfer's timer, which also ends a read that never returns."""
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
