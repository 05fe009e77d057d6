"""model.yaml: a strict schema, and a loader whose errors name the file, line, column and key.

Why PyYAML with its own node walk: the walk keeps the position of every key (pydantic's
error locations are mapped back to lines), refuses duplicate keys (PyYAML would keep the
last one silently), and resolves only ``true``/``false`` as booleans, so ``yes`` stays a
string and a strict boolean field refuses it at its line.

Why the input is bounded: vsnap runs as root and a model.yaml is input from anyone. The file is
read only if it is a regular file of at most MAX_SPEC_BYTES; YAML anchors and aliases are
refused where they appear (chained aliases expand exponentially: a 12-line "billion laughs"
spec took 45 s and 4 GB); nesting is bounded at MAX_DEPTH and the number of values at MAX_NODES
(PyYAML's composer recurses per level and is slow per node); only plain scalars (string, integer,
float, boolean, null) are values.

Why the loader checks the cross-field rules itself: pydantic runs a model validator only after
every field validated, and locates its errors at the root (line 1:1). So the rules (the cpu
engine's serve arguments, "engine vllm needs model", image vs control directory) and the file
checks run on the parsed data beside pydantic's field validation, each located at its own key,
and every problem is reported in one SpecError. Built from Python (no file), ModelSpec checks
the same rules in its model validator.
"""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, NamedTuple, Sequence

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vsnap.host.paths import DEFAULT_CONTROL_ROOT, DEFAULT_IMAGE_ROOT, RUNTIME_DIR, absolute_clean, refuse_system_path
from vsnap.host.trust import open_following_only_roots_links
from vsnap.host.verified import VERIFIED_DIR
from vsnap.protocol.errors import ImageUntrusted, SpecError, SpecIssue

MAX_SPEC_BYTES = 1 << 20
MAX_DEPTH = 20  # the schema needs 3 levels (oracle.prompts[i]); vLLM's JSON arguments a few more
MAX_NODES = 10_000  # 64 prompts and a few dozen serve arguments need a few hundred
# serve arguments the built-in CPU engine understands (vLLM's names for the same things)
CPU_SERVE_ARGS = frozenset({"max_model_len", "served_model_name", "seed"})

Position = tuple[int, int]
Loc = tuple[Any, ...]


# CRIU names the control directory's mount by its path in `--external mnt[PATH]:KEY`, and
# /proc/PID/mountinfo escapes whitespace: a control directory is a plain path.
_CONTROL_DIR_CHARS = re.compile(r"[A-Za-z0-9._@+=%/-]+")


def _image_path(value: str | None) -> str | None:
    if value is None:
        return None
    return refuse_system_path(absolute_clean(value, "image"), "the image",
                              f"a capture with --force replaces it; e.g. {DEFAULT_IMAGE_ROOT}/NAME")


def _control_path(value: str | None) -> str | None:
    if value is None:
        return None
    absolute_clean(value, "control_dir")
    if not _CONTROL_DIR_CHARS.fullmatch(value):
        bad = sorted({c for c in value if not _CONTROL_DIR_CHARS.fullmatch(c)})
        raise ValueError(f"control_dir may hold only letters, digits and . _ @ + = % / - (not {''.join(bad)!r}): "
                         "CRIU names its mount by this path")
    return refuse_system_path(value, "the control directory",
                              f"vsnap makes it private and mounts over it; e.g. {DEFAULT_CONTROL_ROOT}/NAME")


def _argument_name(key: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9_-]{0,63}", key):
        raise ValueError(f"{key!r} is not an argument name (lowercase letters, digits, '_' and '-')")
    return key


# The loader passes this context: it reports the cross-field rules itself, each at its own line.
_LOADER_CONTEXT = {"vsnap_loader": True}


def _by_loader(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("vsnap_loader"))


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
        return _control_path(value)


ORACLE_MAX_LOGPROBS = 1 << 17


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

    @model_validator(mode="after")
    def _fits_the_manifest(self) -> "OracleSettings":
        # the recorded oracle goes into manifest.json (at most 16 MiB, read by every restore):
        # ~40 bytes per logprob there, so 2**17 of them are ~5 MiB and leave the rest its room
        logprobs = len(self.prompts) * self.max_tokens * (self.top_k + 1)
        if logprobs > ORACLE_MAX_LOGPROBS:
            raise ValueError(f"prompts x max_tokens x (top_k + 1) = {logprobs} logprobs to record; at most "
                             f"{ORACLE_MAX_LOGPROBS} fit in an image's manifest: use fewer prompts, tokens or top_k")
        return self


class ModelSpec(_Strict):
    """One model.yaml: what to boot, where its image goes, how it is checked."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    engine: Literal["cpu", "vllm"]
    model: str | None = Field(default=None, description="model directory; cpu: generated when absent")
    image: str | None = Field(default=None, description="image directory; default /var/lib/vsnap/images/<name>")
    serve: dict[Annotated[str, AfterValidator(_argument_name)], Any] = Field(
        default_factory=dict, description="serve arguments, vLLM's own names")
    snapshot: SnapshotSettings = SnapshotSettings()
    oracle: OracleSettings = OracleSettings()

    # where each key was in the model.yaml (empty when built from Python): spec.locate("serve", "dtype")
    _source: str = PrivateAttr(default="")
    _positions: dict[Loc, Position] = PrivateAttr(default_factory=dict)

    @field_validator("model")
    @classmethod
    def _model_path(cls, value: str | None) -> str | None:
        return None if value is None else absolute_clean(value, "model")

    @field_validator("image")
    @classmethod
    def _image_path(cls, value: str | None) -> str | None:
        return _image_path(value)

    @field_validator("serve")
    @classmethod
    def _serve(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        normalized: dict[str, Any] = {}
        for key, item in value.items():
            name = key.replace("-", "_")
            if name in normalized and not _by_loader(info):
                raise ValueError(f"{name} is given twice (with '-' and with '_')")
            normalized[name] = item
        return normalized

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "ModelSpec":
        if not _by_loader(info):
            problems = rule_problems(self.model_dump())
            if problems:
                raise ValueError("; ".join(f"{_dotted(p.field)}: {p.message}" for p in problems))
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

    def locate(self, *loc: Any) -> tuple[str, int | None, int | None]:
        """(file, line, column) of a key in the model.yaml this spec came from, e.g. ("serve", "dtype")."""
        line, column = _locate(tuple(loc), self._positions) or (None, None)
        return self._source, line, column


# --- rules across fields, on parsed data: each problem at its own key ------------------------


class Problem(NamedTuple):
    field: Loc  # what is wrong
    where: Loc  # the key whose line the problem is reported at
    message: str
    of_key: bool = False  # about the key itself, so reported even when its value was refused


def _clean_abs(value: Any) -> str | None:
    """``value`` if it is an absolute path without '..' (the fields' own validators report the rest)."""
    if isinstance(value, str) and value.startswith("/") and ".." not in Path(value).parts:
        return os.path.normpath(value)
    return None


def _usable(value: Any) -> str | None:
    """``value`` if it may be an image or control directory (else its field validator reports it)."""
    path = _clean_abs(value)
    try:
        return path and refuse_system_path(path, "", "")
    except ValueError:
        return None


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def rule_problems(data: Mapping[str, Any]) -> list[Problem]:
    """The rules that span fields, checked on a spec's data (from YAML: not yet validated, so every
    value is looked at with care; a value of the wrong type is the field validators' to report)."""
    problems: list[Problem] = []
    engine = data.get("engine")
    serve = data.get("serve") if isinstance(data.get("serve"), dict) else {}
    if engine == "vllm" and data.get("model") is None:
        problems.append(Problem(("model",), ("engine",), "engine vllm needs 'model': the directory of the model's files"))
    seen: dict[str, str] = {}
    for key, value in serve.items():
        if not isinstance(key, str):
            continue
        name = key.replace("-", "_")
        if name in seen:
            problems.append(Problem(("serve", key), ("serve", key), f"given twice (also as {seen[name]})",
                                    of_key=True))
            continue
        seen[name] = key
        if engine != "cpu":
            continue
        if name not in CPU_SERVE_ARGS:
            problems.append(Problem(("serve", key), ("serve", key), "not understood by the cpu engine "
                                    f"(it takes {', '.join(sorted(CPU_SERVE_ARGS))})", of_key=True))
        elif name == "max_model_len" and (not isinstance(value, int) or isinstance(value, bool)
                                          or not 16 <= value <= 4096):
            problems.append(Problem(("serve", key), ("serve", key),
                                    "must be an integer from 16 to 4096 for the cpu engine"))
        elif name == "seed" and (not isinstance(value, int) or isinstance(value, bool)):
            problems.append(Problem(("serve", key), ("serve", key), "must be an integer"))
        elif name == "served_model_name" and (not isinstance(value, str) or not 0 < len(value) <= 256):
            problems.append(Problem(("serve", key), ("serve", key),
                                    "must be a string of 1 to 256 characters for the cpu engine"))
    problems += _directory_problems(data)
    return problems


def _directory_problems(data: Mapping[str, Any]) -> list[Problem]:
    """The image, the control directory and the model must stay apart: a capture with --force
    replaces the image, and failed runs' directories beside the control directory are pruned."""
    name = data.get("name")
    name = name if isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name) else None
    snapshot = data.get("snapshot") if isinstance(data.get("snapshot"), dict) else {}
    image = _usable(data.get("image")) or (str(DEFAULT_IMAGE_ROOT / name) if name and data.get("image") is None
                                              else None)
    control = _usable(snapshot.get("control_dir")) or (
        str(DEFAULT_CONTROL_ROOT / name) if name and snapshot.get("control_dir") is None else None)
    model = _clean_abs(data.get("model"))
    image_at: Loc = ("image",) if data.get("image") is not None else ("name",)
    control_at: Loc = ("snapshot", "control_dir") if snapshot.get("control_dir") is not None else ("name",)
    problems = []
    for field, where, path in ((("image",), image_at, image), (("snapshot", "control_dir"), control_at, control)):
        for what, state in _state_dirs():
            if path is not None and (_inside(path, state) or _inside(state, path)):
                problems.append(Problem(field, where, f"{path} would hold vsnap's {what} ({state}); "
                                        f"choose another {_dotted(field)} (or name)"))
    if image is not None and control is not None and (
            _inside(image, control) or _inside(control, image) or _inside(image, control + ".instances")):
        problems.append(Problem(("image",), image_at, f"{image} and the control directory {control} overlap; "
                                "a capture replaces the image, and old run directories beside the control "
                                "directory are removed: keep them apart"))
    if image is not None and model is not None and _inside(model, image):
        problems.append(Problem(("image",), image_at, f"{image} holds the model {model}; a capture with --force "
                                "would delete it: put the image elsewhere"))
    return problems


def _state_dirs() -> list[tuple[str, str]]:
    """vsnap's own state, which no image or control directory may hold (a capture with --force
    would replace it, a control directory would be mounted over it)."""
    return [("registry of running instances", str(RUNTIME_DIR / "instances")),
            ("records of running captures", str(RUNTIME_DIR / "captures")),
            ("cache of verified image files", str(VERIFIED_DIR))]


MAX_CONFIG_BYTES = 4 << 20  # a model's config.json has a few KB; vLLM and transformers read it whole


def _file_problems(data: Mapping[str, Any]) -> list[Problem]:
    """The files a spec names must exist before anything is launched."""
    model = _clean_abs(data.get("model"))
    if model is None:
        return []
    path = Path(model)
    if not path.exists():
        return [Problem(("model",), ("model",), f"{path} does not exist")]
    if not path.is_dir() or not (path / "config.json").is_file():
        return [Problem(("model",), ("model",), f"{path} is not a model directory with config.json")]
    size = (path / "config.json").stat().st_size  # vLLM reads it whole, before vsnap's own bounded reading
    if size > MAX_CONFIG_BYTES:
        return [Problem(("model",), ("model",), f"{path}/config.json has {size} bytes, over the "
                                                 f"{MAX_CONFIG_BYTES >> 20} MiB a model's config may have")]
    return []


# --- YAML with positions, bounded ------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, mark: Any, message: str) -> None:
        super().__init__(message)
        self.mark, self.message = mark, message


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader whose only booleans are true/false (YAML 1.2), so 'yes' stays a string; it refuses
    anchors and aliases, and bounds nesting and the number of values, while it composes."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(event.start_mark, f"YAML aliases (*{event.anchor}) are not allowed in a model.yaml; "
                                             "write the value out")
        if getattr(event, "anchor", None) is not None:
            raise _Refused(event.start_mark, f"YAML anchors (&{event.anchor}) are not allowed in a model.yaml; "
                                             "write the value out where it is used")
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _Refused(event.start_mark, f"more than {MAX_NODES} values; not a model.yaml")
        if self._depth >= MAX_DEPTH:
            raise _Refused(event.start_mark, f"nested deeper than {MAX_DEPTH} levels; not a model.yaml")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)

_TAG = "tag:yaml.org,2002:"
SCALAR_TAGS = {_TAG + t for t in ("str", "int", "float", "bool", "null")}
_TAG_NAMES = {_TAG + "timestamp": "a date or time (quote it to make it a string)", _TAG + "binary": "binary data",
              _TAG + "merge": "a merge key (<<)", _TAG + "value": "a value key (=)"}


def _mark(node: Any) -> Position:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _dotted(path: Loc) -> str:
    return ".".join(str(p) for p in path)


# An issue of a key (not of a value) hides no other problem: its loc matches nothing.
_KEY = object()
BadValue = tuple[Loc, SpecIssue]


def _walk(loader: _StrictLoader, node: yaml.Node, path: Loc, positions: dict[Loc, Position],
          issues: list[BadValue], file: str) -> Any:
    """Plain data from a node; every value that cannot be one is an issue at its position (and None)."""
    positions.setdefault(path, _mark(node))

    def bad(at: Any, loc: Loc, message: str) -> None:
        issues.append((loc, SpecIssue(file, *_mark(at), _dotted(p for p in loc if p is not _KEY), message)))

    if isinstance(node, yaml.MappingNode):
        if node.tag != _TAG + "map":
            bad(node, path, f"tag {node.tag} is not allowed here")
        result: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _TAG + "str":
                what = _TAG_NAMES.get(key_node.tag, "")
                bad(key_node, path + (_KEY,), "keys must be plain strings" + (f", not {what}" if what else ""))
                continue
            key = key_node.value
            if key in result:
                bad(key_node, path + (key, _KEY), "duplicate key")
                continue
            positions[path + (key,)] = _mark(key_node)
            result[key] = _walk(loader, value_node, path + (key,), positions, issues, file)
        return result
    if isinstance(node, yaml.SequenceNode):
        if node.tag != _TAG + "seq":
            bad(node, path, f"tag {node.tag} is not allowed here")
        return [_walk(loader, item, path + (i,), positions, issues, file) for i, item in enumerate(node.value)]
    if node.tag not in SCALAR_TAGS:
        what = _TAG_NAMES.get(node.tag, f"tag {node.tag}")
        bad(node, path, f"{what} is not allowed; values are strings, numbers, true/false or null")
        return None
    try:
        value = loader.construct_object(node, deep=True)
    except (ValueError, OverflowError, yaml.YAMLError):  # e.g. an integer of 5000 digits
        bad(node, path, f"cannot be read as {node.tag.removeprefix(_TAG)}"
                        + (" (more than 4300 digits)" if len(node.value) > 4300 else ""))
        return None
    if isinstance(value, float) and not math.isfinite(value):
        bad(node, path, "must be a finite number")
        return None
    return value


def _position_in(text: str, index: int) -> Position:
    before = text[:index]
    return before.count("\n") + 1, index - (before.rfind("\n") + 1) + 1


def parse_yaml(text: str, file: str) -> tuple[Any, dict[Loc, Position]]:
    """Parse YAML into plain data plus the position of every key and item."""
    data, positions, bad = _parse_yaml(text, file)
    if bad:
        raise SpecError([issue for _, issue in bad])
    return data, positions


def _parse_yaml(text: str, file: str) -> tuple[Any, dict[Loc, Position], list[BadValue]]:
    """Like parse_yaml, but the values that cannot be data come back (as None in the data) with
    their issues, so validation can report the other problems beside them."""
    loader = None
    try:
        loader = _StrictLoader(text)  # the reader refuses control characters here
        node = loader.get_single_node()
    except _Refused as exc:
        raise SpecError([SpecIssue(file, exc.mark.line + 1, exc.mark.column + 1, "", exc.message)]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = " ".join(p for p in (exc.context, exc.problem) if p) or "cannot be parsed"
        raise SpecError([SpecIssue(file, mark.line + 1 if mark else None, mark.column + 1 if mark else None, "",
                                   f"not valid YAML: {problem}")]) from None
    except yaml.reader.ReaderError as exc:
        line, column = _position_in(text, exc.position)
        raise SpecError([SpecIssue(file, line, column, "", f"not valid YAML: character #x{exc.character:04x} "
                                                           "is not allowed")]) from None
    except yaml.YAMLError as exc:
        raise SpecError([SpecIssue(file, None, None, "", f"not valid YAML: {str(exc).splitlines()[0]}")]) from None
    except RecursionError:  # cannot happen below MAX_DEPTH; never a traceback
        raise SpecError([SpecIssue(file, None, None, "", "nested too deeply; not a model.yaml")]) from None
    finally:
        if loader is not None:
            loader.dispose()
    positions: dict[Loc, Position] = {}
    bad: list[BadValue] = []
    if node is None:
        return None, positions, bad
    data = _walk(loader, node, (), positions, bad, file)
    return data, positions, bad


def _locate(loc: Loc, positions: dict[Loc, Position]) -> Position | None:
    for end in range(len(loc), -1, -1):
        if loc[:end] in positions:
            return positions[loc[:end]]
    return None


def spec_from_data(data: Any, positions: dict[Loc, Position], file: str, *, bad_values: Sequence[BadValue] = (),
                   from_command_line: frozenset[str] = frozenset(), check_files: bool = False) -> ModelSpec:
    """Validate parsed data: field errors, the cross-field rules and (``check_files``) the files the
    spec names, all of them in one SpecError in file order, each at its own line. ``bad_values``
    are the parser's issues (their values are None in ``data``: nothing else is reported for them).
    Keys in ``from_command_line`` were given as CLI options: their problems name no line."""
    if not isinstance(data, dict):
        raise SpecError([issue for _, issue in bad_values] or [
            SpecIssue(file, 1, 1, "", "the spec must be a mapping of keys (name, engine, model, ...)")])
    issues = [issue for _, issue in bad_values]

    def add(loc: Loc, where: Loc, message: str, of_key: bool = False) -> None:
        if not of_key and any(loc[:len(known)] == known for known, _ in bad_values):
            return  # already reported by the parser
        field = _dotted(loc)
        if where and where[0] in from_command_line:
            issues.append(SpecIssue(file, None, None, field, f"{message} (given on the command line)"))
            return
        line, column = _locate(where, positions) or (None, None)
        issues.append(SpecIssue(file, line, column, field, message))

    spec = None
    try:
        spec = ModelSpec.model_validate(data, context=_LOADER_CONTEXT)
    except ValidationError as exc:
        for error in exc.errors():
            loc = tuple(p for p in error["loc"] if p != "[key]")
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] == "extra_forbidden":
                message = "unknown key"
            add(loc, loc, message)
    for problem in rule_problems(data) + (_file_problems(data) if check_files else []):
        add(*problem)
    if issues:
        issues.sort(key=lambda i: (i.line is None, i.line or 0, i.column or 0))
        raise SpecError(issues)
    assert spec is not None
    spec._source, spec._positions = file, positions
    return spec


def read_spec_text(path: Path) -> str:
    """The text of a model.yaml: a regular file (never a FIFO or a device, which could block or
    never end) of at most MAX_SPEC_BYTES, in UTF-8."""
    file = str(path)

    def refuse(message: str, line: int | None = None, column: int | None = None) -> SpecError:
        return SpecError([SpecIssue(file, line, column, "", message)])


    try:
        fd = open_following_only_roots_links(path)  # a link of another user's could point at /etc/shadow
    except ImageUntrusted as exc:
        raise refuse(exc.reason) from None
    except FileNotFoundError:
        raise refuse("file not found") from None
    except OSError as exc:
        raise refuse(f"cannot be read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refuse("is not a regular file; a model.yaml is a file")
        if st.st_size > MAX_SPEC_BYTES:
            raise refuse(f"larger than {MAX_SPEC_BYTES} bytes; not a model.yaml")
        chunks, size = [], 0
        while size <= MAX_SPEC_BYTES:
            chunk = os.read(fd, MAX_SPEC_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_SPEC_BYTES:
            raise refuse(f"larger than {MAX_SPEC_BYTES} bytes; not a model.yaml")
    except OSError as exc:
        raise refuse(f"cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise refuse(f"is not UTF-8 text (byte {exc.start})", line) from None


def load_spec(path: Path | str, overrides: dict[str, Any] | None = None) -> ModelSpec:
    """Read and validate a model.yaml, and check the files it names. ``overrides`` (top-level keys
    from the CLI, such as {"image": ...}) are merged before validation, so they pass the same checks."""
    path = Path(path)
    file = str(path)
    data, positions, bad = _parse_yaml(read_spec_text(path), file)
    if overrides and isinstance(data, dict):
        data = {**data, **overrides}
    return spec_from_data(data, positions, file, bad_values=bad, from_command_line=frozenset(overrides or ()),
                          check_files=True)


def check_spec_files(spec: ModelSpec, positions: dict[Loc, Position], file: str) -> None:
    """The files a spec names must exist before anything is launched (load_spec checks them too)."""
    problems = _file_problems(spec.model_dump())
    if problems:
        raise SpecError([SpecIssue(file, *(_locate(p.where, positions) or (None, None)), _dotted(p.field), p.message)
                         for p in problems],
                        hint="point 'model' at the model's directory, or leave it out for the cpu engine")
