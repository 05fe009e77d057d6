"""A fake image for unit tests: a real manifest (every field valid) over a few small files,
written as a capture writes them (root's, 0700/0600), without CRIU or an engine."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from vsnap.image.manifest import FORMAT_VERSION, MANIFEST, FileEntry, HostFacts, ImageLaunch, Manifest
from vsnap.protocol.control import PROTOCOL_VERSION
from vsnap.protocol.oracle import Oracle, OracleSample

FILES = {"criu/pages-1.img": b"pages" * 100, "criu/inventory.img": b"inv", "logs/engine.log": b"log\n"}


def host_facts(**overrides: Any) -> HostFacts:
    facts: dict[str, Any] = dict(hostname="capture-host", kernel="6.1.0", arch="x86_64", criu="4.2.1",
                                 python="3.11.7", torch="2.13.0+cpu", vsnap="0.2.0")
    facts.update(overrides)
    return HostFacts(**facts)


def manifest(files: dict[str, bytes] | None = None, **overrides: Any) -> Manifest:
    files = FILES if files is None else files
    fields: dict[str, Any] = dict(
        format_version=FORMAT_VERSION, protocol_version=PROTOCOL_VERSION, vsnap_version="0.2.0",
        created_at="2026-12-01T10:00:00+00:00", name="fake", engine="cpu", spec={"name": "fake"},
        launch=ImageLaunch(engine="cpu", model="/var/lib/vsnap/models/cpu-tiny-v1", served_model_name="fake",
                           oracle_prompts=["a"], oracle_max_tokens=2, oracle_top_k=2, oracle_tolerance=0.0,
                           timeout_s=60),
        control_dir="/run/vsnap/fake", control_mount_key="m0", shm_mount_key="m1", netns_key="extNetNs",
        oracle=Oracle(samples=[OracleSample(prompt="a", token_ids=[1], logprobs=[{"1": -0.1}])]),
        host=host_facts(), externals={},
        files={rel: FileEntry(size=len(data), digest=hashlib.sha256(data).hexdigest(), scheme="sha256")
               for rel, data in files.items()})
    fields.update(overrides)
    return Manifest(**fields)


def make_image(path: Path, files: dict[str, bytes] | None = None, raw: dict | None = None,
               **overrides: Any) -> Path:
    """An image at ``path`` (its parent made private): ``files`` and a manifest listing them
    (``raw``: write that JSON as the manifest instead)."""
    files = FILES if files is None else files
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    path.mkdir(mode=0o700)
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        (path / rel).write_bytes(data)
        os.chmod(path / rel, 0o600)
    text = json.dumps(raw) if raw is not None else manifest(files, **overrides).model_dump_json()
    (path / MANIFEST).write_text(text)
    os.chmod(path / MANIFEST, 0o600)
    return path
