"""The spec's vLLM serve arguments as the spec wrote them (``-`` or ``_`` in a key), and what the
restored server reads from them when it starts (its TLS files). No imports beyond typing: a
restore asks these before anything else of vLLM's rules is needed (vllm.rules costs ~20 ms to
import)."""

from __future__ import annotations

from typing import Any

# the files uvicorn reads when the restored server starts (after the restore, not at boot)
SERVING_FILES = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs")


def given(serve: dict[str, Any], name: str) -> tuple[bool, Any]:
    """(given, value) of a serve argument as the spec wrote it (``-`` or ``_`` in its key)."""
    for key in (name, name.replace("_", "-")):
        if key in serve:
            return True, serve[key]
    return False, None


def serves_tls(serve: dict[str, Any]) -> bool:
    """Does the server speak HTTPS (uvicorn turns TLS on with a key file or a certificate file)?"""
    return any(isinstance(v, str) and v for v in (given(serve, n)[1] for n in ("ssl_keyfile", "ssl_certfile")))


def files_read_when_serving(serve: dict[str, Any]) -> list[tuple[str, str]]:
    """(argument, path) of the TLS files the spec names: read as root when the restored server
    starts, after every restore (a restore checks they are root's alone again; their bytes may
    change: a renewed certificate is read as it is then)."""
    found = ((name, given(serve, name)[1]) for name in SERVING_FILES)
    return [(name, value) for name, value in found if isinstance(value, str) and value]
