"""validate_target(): will this host capture this spec, or restore this image? Every check, each verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

from vsnap.host.facts import Check, preflight, run_check
from vsnap.host.trust import require_trusted_ancestors, require_trusted_model, require_trusted_tree
from vsnap.host.verified import VERIFIED_DIR
from vsnap.image.compat import host_differences, model_missing_hint
from vsnap.image.handle import open_image
from vsnap.image.manifest import MANIFEST
from vsnap.image.store import (
    CONTROL_OUTSIDE_IMAGES,
    IMAGE_OUTSIDE_IMAGES,
    require_outside_images,
    require_recorded_control_dir,
)
from vsnap.protocol.errors import ImageHostMismatch, VsnapError
from vsnap.spec.schema import load_spec

from . import resources


@dataclass
class ValidationReport:
    target: str | None
    kind: str  # "host", "spec" or "image"
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def first_error(self) -> VsnapError | None:
        return next((c.error for c in self.checks if c.error is not None), None)


def validate_target(target: Path | None) -> ValidationReport:
    if target is None:
        return ValidationReport(None, "host", preflight(None, "restore"))
    if _looks_like_image(target):
        return _validate_image(target)
    return _validate_spec(target)


def _looks_like_image(target: Path) -> bool:
    """A directory (or a path with a manifest) is an image; anything else, even a path that cannot
    be looked at (too long, no permission), is read as a spec, whose loader says what is wrong."""
    try:
        return target.is_dir() or (target / MANIFEST).exists()
    except OSError:
        return False


def _validate_spec(path: Path) -> ValidationReport:
    report = ValidationReport(str(path), "spec")
    try:
        spec = load_spec(path)
    except VsnapError as exc:
        report.checks.append(Check("spec", False, exc.message, exc))
        return report
    report.checks.append(Check("spec", True, f"{spec.name}: engine {spec.engine}, image {spec.image_dir}"))
    report.checks.extend(preflight(spec.engine))
    model = run_check("model", lambda: (require_trusted_model(Path(spec.model)),  # type: ignore[arg-type]
                                        f"{spec.model} is root's alone")[1]) if spec.model is not None else None
    if spec.engine == "vllm":
        from vsnap.spec.vllm_check import require_supported_args, vllm_version_check

        version = vllm_version_check()  # names the tested versions; a warning on any other
        report.checks += [version] if version is not None else []
        if model is not None and not model.ok:  # vLLM would read the files of a model root must not trust
            report.checks.append(Check("vllm arguments", True, "not checked: the model is refused below",
                                       warning=True))
        else:
            report.checks.append(run_check("vllm arguments",
                                           lambda: require_supported_args(spec, str(path), warn=None)))
    report.checks.append(run_check("image directory", lambda: (
        require_outside_images(spec.image_dir, "the image", IMAGE_OUTSIDE_IMAGES),
        require_trusted_ancestors(spec.image_dir), f"{spec.image_dir.parent} is root's alone (or will be made so)")[2]))
    report.checks += [model] if model is not None else []
    report.checks.append(run_check("control directory", lambda: (
        require_outside_images(spec.control_dir, "the control directory", CONTROL_OUTSIDE_IMAGES, itself=True),
        require_trusted_ancestors(spec.control_dir), f"{spec.control_dir.parent} is root's alone (or will be made so)")[2]))
    model_dir = Path(spec.model) if spec.model is not None else None
    report.checks += _resource_checks(lambda: resources.capture_needs(spec, model_dir, spec.image_dir,
                                                                      resources.capture_gpus(spec)), "capture")
    return report


def _resource_checks(needs: Callable[[], list[resources.Need]], action: str) -> list[Check]:
    """One row per resource; a shortfall is the error a capture or a restore would raise."""
    try:
        computed = needs()
    except VsnapError as exc:
        return [Check("resources", False, exc.message, exc)]
    except OSError as exc:  # a model or image path that cannot be read: the other rows say why
        return [Check("resources", True, f"not computed ({exc.strerror})", warning=True)]
    rows = []
    for need in computed:
        try:
            resources.require([need], action)
            rows.append(Check(need.resource, True, need.line))
        except VsnapError as exc:
            rows.append(Check(need.resource, False, exc.message, exc))
    return rows


def _validate_image(image_dir: Path) -> ValidationReport:
    """Trust first: nothing an untrusted image names (its manifest, its dependencies) is read."""
    report = ValidationReport(str(image_dir), "image")
    trust = run_check("trust", lambda: (require_trusted_tree(image_dir.absolute()),
                                        "the image and its parents are root's alone")[1])
    report.checks.append(trust)
    if not trust.ok:
        return report
    try:  # (trust was just checked, on its own line; no lock: validating holds off no capture)
        image = open_image(image_dir, trusted=False, lock=False)
    except VsnapError as exc:
        report.checks.append(Check("manifest", False, exc.message, exc))
        return report
    manifest = image.manifest
    report.checks.append(Check("manifest", True, f"{manifest.name}: engine {manifest.engine}, "
                                                 f"captured {manifest.created_at} on {manifest.host.hostname}"))
    control = run_check("control directory", lambda: (require_recorded_control_dir(manifest.control_dir),
                                                       f"{manifest.control_dir}: usable")[1])
    report.checks.append(control)
    if not control.ok:
        return report
    # every file hashed; the result is remembered, so a restore right after need not hash again
    files = run_check("image files", lambda: (
        image.verify_files(rehash=True),
        f"{len(manifest.files)} files match their digests")[1])
    report.checks.append(files)
    if not files.ok:
        return report  # an altered manifest's dependency paths are not read either

    # every dependency hashed, and remembered: a restore right after need not read them again
    differences = host_differences(manifest, hash_files=True, cache_root=VERIFIED_DIR, rehash=True)
    fatal = [d for d in differences if d.fatal]
    if fatal:
        error = ImageHostMismatch([d.triple for d in fatal], hint=model_missing_hint(manifest, fatal))
        report.checks.append(Check("host match", False, error.message, error))
    else:
        report.checks.append(Check("host match", True, f"python {manifest.host.python}, torch {manifest.host.torch}, "
                                                       f"{len(manifest.dependencies)} files unchanged"))
    report.checks += [Check(f"host {d.fact}", True, f"{d.line}: not refused ({d.why})", warning=True)
                      for d in differences if not d.fatal]
    report.checks += _resource_checks(lambda: resources.restore_needs(manifest), "restore")
    report.checks.extend(c for c in preflight(None, "restore") if c.name != "unshare")
    return report
