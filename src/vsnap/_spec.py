"""model.yaml: a strict schema, and a loader whose errors name the file, line, column and key.

Why PyYAML with its own node walk: the walk keeps the position of every key (pydantic's
error locations are mapped back to lines), refuses duplicate keys (PyYAML would keep the
last one silently), and resolves only ``true``/``false`` as booleans, so ``yes`` stays a
string and a strict boolean field refuses it at its line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .protocol.errors import SpecError, SpecIssue

MAX_SPEC_BYTES = 1 << 20
DEFAULT_IMAGE_ROOT = Path("/var/lib/vsnap/images")
DEFAULT_CONTROL_ROOT = Path("/run/vsnap")
# serve arguments the built-in CPU engine understands (vLLM's names for the same things)
CPU_SERVE_ARGS = frozenset({"max_model_len", "served_model_name", "seed"})

Position = tuple[int, int]


def _absolute_clean(value: str, what: str) -> str:
    path = Path(value)
    if not path.is_absolute():
        raise ValueError(f"{what} must be an absolute path (got {value!r})")
    if ".." in path.parts:
        raise ValueError(f"{what} must not contain '..' (got {value!r})")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class SnapshotSettings(_Strict):
    control_dir: str | None = Field(
        default=None, description="private directory of the control files; default /run/vsnap/<name>"
    )
    timeout_s: float = Field(default=900, gt=0, le=7 * 24 * 3600, allow_inf_nan=False)
    weights: Literal["image", "model"] = Field(
        default="image",
        description="vllm: 'image' keeps the loaded weights in the image (one flat file, streamed back "
                    "at restore); 'model' reloads them from the model's files (smaller image, slower restore)",
    )

    @field_validator("control_dir")
    @classmethod
    def _control_dir(cls, value: str | None) -> str | None:
        return None if value is None else _absolute_clean(value, "control_dir")


class OracleSettings(_Strict):
    prompts: list[str] = Field(
        default=["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,"], min_length=1, max_length=64
    )
    max_tokens: int = Field(default=8, ge=1, le=512)
    top_k: int = Field(default=5, ge=1, le=20)
    tolerance: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False)

    @field_validator("prompts")
    @classmethod
    def _prompts(cls, value: list[str]) -> list[str]:
        for prompt in value:
            if not prompt or len(prompt) > 8192:
                raise ValueError("each prompt must hold 1 to 8192 characters")
        return value


class ModelSpec(_Strict):
    """One model.yaml: what to boot, where its image goes, how it is checked."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    engine: Literal["cpu", "vllm"]
    model: str | None = Field(default=None, description="model directory; cpu: generated when absent")
    image: str | None = Field(default=None, description="image directory; default /var/lib/vsnap/images/<name>")
    serve: dict[str, Any] = Field(default_factory=dict, description="serve arguments, vLLM's own names")
    snapshot: SnapshotSettings = SnapshotSettings()
    oracle: OracleSettings = OracleSettings()

    @field_validator("model", "image")
    @classmethod
    def _paths(cls, value: str | None, info: Any) -> str | None:
        return None if value is None else _absolute_clean(value, info.field_name)

    @field_validator("serve")
    @classmethod
    def _serve(cls, value: dict[str, Any]) -> dict[str, Any]:
        normalized: dict[str, Any] = {}
        for key, item in value.items():
            if not re.fullmatch(r"[a-z][a-z0-9_-]{0,63}", key):
                raise ValueError(f"{key!r} is not an argument name")
            normalized[key.replace("-", "_")] = item
        return normalized

    @model_validator(mode="after")
    def _engine_rules(self) -> "ModelSpec":
        if self.engine == "vllm" and self.model is None:
            raise ValueError("engine vllm needs 'model': the directory of the model's files")
        if self.engine == "cpu":
            unknown = sorted(set(self.serve) - CPU_SERVE_ARGS)
            if unknown:
                raise ValueError(
                    f"serve.{unknown[0]} is not understood by the cpu engine "
                    f"(it takes {', '.join(sorted(CPU_SERVE_ARGS))})"
                )
            max_len = self.serve.get("max_model_len", 256)
            if not isinstance(max_len, int) or isinstance(max_len, bool) or not 16 <= max_len <= 4096:
                raise ValueError("serve.max_model_len must be an integer from 16 to 4096 for the cpu engine")
        return self

    @property
    def image_dir(self) -> Path:
        return Path(self.image) if self.image else DEFAULT_IMAGE_ROOT / self.name

    @property
    def control_dir(self) -> Path:
        return Path(self.snapshot.control_dir) if self.snapshot.control_dir else DEFAULT_CONTROL_ROOT / self.name

    @property
    def served_model_name(self) -> str:
        return str(self.serve.get("served_model_name", self.name))


# --- YAML with positions -------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader whose only booleans are true/false (YAML 1.2), so 'yes' stays a string."""


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _mark(node: yaml.Node) -> Position:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _walk(loader: _StrictLoader, node: yaml.Node, path: tuple[Any, ...], positions: dict[tuple[Any, ...], Position],
          issues: list[SpecIssue], file: str) -> Any:
    positions.setdefault(path, _mark(node))
    if isinstance(node, yaml.MappingNode):
        result: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                line, col = _mark(key_node)
                issues.append(SpecIssue(file, line, col, ".".join(map(str, path)), "keys must be plain strings"))
                continue
            key = key_node.value
            if key in result:
                line, col = _mark(key_node)
                issues.append(SpecIssue(file, line, col, ".".join(map(str, path + (key,))), "duplicate key"))
                continue
            positions[path + (key,)] = _mark(key_node)
            result[key] = _walk(loader, value_node, path + (key,), positions, issues, file)
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_walk(loader, item, path + (i,), positions, issues, file) for i, item in enumerate(node.value)]
    return loader.construct_object(node, deep=True)


def parse_yaml(text: str, file: str) -> tuple[Any, dict[tuple[Any, ...], Position]]:
    """Parse YAML into plain data plus the position of every key and item."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        raise SpecError([SpecIssue(file, mark.line + 1 if mark else None, mark.column + 1 if mark else None, "",
                                   f"not valid YAML: {exc.problem}")]) from None
    except yaml.YAMLError as exc:
        raise SpecError([SpecIssue(file, None, None, "", f"not valid YAML: {exc}")]) from None
    finally:
        loader.dispose()
    positions: dict[tuple[Any, ...], Position] = {}
    issues: list[SpecIssue] = []
    if node is None:
        return None, positions
    data = _walk(loader, node, (), positions, issues, file)
    if issues:
        raise SpecError(issues)
    return data, positions


def _locate(loc: tuple[Any, ...], positions: dict[tuple[Any, ...], Position]) -> Position | None:
    for end in range(len(loc), -1, -1):
        if loc[:end] in positions:
            return positions[loc[:end]]
    return None


def spec_from_data(data: Any, positions: dict[tuple[Any, ...], Position], file: str) -> ModelSpec:
    if not isinstance(data, dict):
        raise SpecError([SpecIssue(file, 1, 1, "", "the spec must be a mapping of keys (name, engine, model, ...)")])
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as exc:
        issues = []
        for error in exc.errors():
            loc = tuple(error["loc"])
            line, column = _locate(loc, positions) or (None, None)
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] == "extra_forbidden":
                message = "unknown key"
            issues.append(SpecIssue(file, line, column, ".".join(str(p) for p in loc), message))
        raise SpecError(issues) from None


def load_spec(path: Path | str, overrides: dict[str, Any] | None = None) -> ModelSpec:
    """Read and validate a model.yaml. ``overrides`` (from the CLI) are merged before validation."""
    path = Path(path)
    file = str(path)
    try:
        if path.stat().st_size > MAX_SPEC_BYTES:
            raise SpecError([SpecIssue(file, None, None, "", f"larger than {MAX_SPEC_BYTES} bytes; not a model.yaml")])
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([SpecIssue(file, None, None, "", "file not found")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([SpecIssue(file, None, None, "", f"cannot be read: {exc}")]) from None
    data, positions = parse_yaml(text, file)
    if overrides and isinstance(data, dict):
        data = {**data, **overrides}
    spec = spec_from_data(data, positions, file)
    check_spec_files(spec, positions, file)
    return spec


def check_spec_files(spec: ModelSpec, positions: dict[tuple[Any, ...], Position], file: str) -> None:
    """The files a spec names must exist before anything is launched."""
    if spec.model is None:
        return
    model = Path(spec.model)
    line, column = positions.get(("model",), (None, None))
    if not model.exists():
        raise SpecError([SpecIssue(file, line, column, "model", f"{model} does not exist")],
                        hint="point 'model' at the model's directory, or leave it out for the cpu engine")
    if not model.is_dir() or not (model / "config.json").is_file():
        raise SpecError([SpecIssue(file, line, column, "model", f"{model} is not a model directory with config.json")])
