"""protocol.records: the strict reader of the control messages, the oracle, the manifest and the
instance records (no pydantic on a restore's path). What vsnap wrote before them (pydantic's JSON,
tests/unit/data/pydantic-written-records.json: written by d027cb0's models) reads the same; what
does not fit is refused at its path, in pydantic's words."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest

from vsnap._instances import CaptureRecord, InstanceRecord
from vsnap._manifest import Manifest
from vsnap.protocol import control
from vsnap.protocol.oracle import Oracle
from vsnap.protocol.records import Record, RecordError, field

WRITTEN = json.loads((Path(__file__).parent / "data" / "pydantic-written-records.json").read_text())
KINDS: dict[str, type[Record]] = {
    "manifest": Manifest, "ready": control.Ready, "status": control.Status, "error": control.ErrorReport,
    "activation": control.Activation, "standby": control.Standby, "owner": control.Owner,
    "launch": control.LaunchConfig, "instance": InstanceRecord, "capture": CaptureRecord,
}


class Inner(Record):
    n: int = field(ge=1, le=3)


class Outer(Record):
    name: str
    kind: Literal["a", "b"] = "a"
    ratio: float = 0.5
    flag: bool = False
    maybe: Inner | None = None
    items: list[Inner] = field(default_factory=list)
    table: dict[str, float] = field(default_factory=dict)
    anything: Any = None


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_what_pydantic_wrote_reads_the_same_and_round_trips(kind: str) -> None:
    record = KINDS[kind].model_validate_json(json.dumps(WRITTEN[kind]))
    assert record.model_dump() == WRITTEN[kind]  # every field, none added or lost
    assert type(record).model_validate_json(record.model_dump_json()) == record
    assert type(record).model_validate_json(record.model_dump_json(indent=2)) == record


def test_nested_records_are_built_and_kept_typed() -> None:
    ready = control.Ready.model_validate(WRITTEN["ready"])
    assert isinstance(ready.oracle, Oracle) and ready.oracle.samples[1].model == "lora-a"
    manifest = Manifest.model_validate(WRITTEN["manifest"])
    assert manifest.host.gpus[0]["name"] == "NVIDIA H200" and manifest.captured_gpus() == [
        "GPU-0123abcd-0000-1111-2222-333344445555"]
    assert manifest.dependencies[0].sha256 is None and manifest.launch.timeout_s == 60.0
    instance = InstanceRecord.model_validate(WRITTEN["instance"])
    assert instance.pid == 10 and instance.owner == instance.tree


@pytest.mark.parametrize("document,where,message", [
    ({}, "name", "Field required"),
    ({"name": "x", "extra": 1}, "extra", "Extra inputs are not permitted"),
    ({"name": 5}, "name", "Input should be a valid string"),
    ({"name": "x", "kind": "c"}, "kind", "Input should be 'a' or 'b'"),
    ({"name": "x", "ratio": "0.5"}, "ratio", "Input should be a valid number"),
    ({"name": "x", "ratio": True}, "ratio", "Input should be a valid number"),
    ({"name": "x", "flag": 1}, "flag", "Input should be a valid boolean"),
    ({"name": "x", "maybe": {"n": 0}}, "maybe.n", "Input should be greater than or equal to 1"),
    ({"name": "x", "maybe": {"n": 4}}, "maybe.n", "Input should be less than or equal to 3"),
    ({"name": "x", "maybe": {"n": True}}, "maybe.n", "Input should be a valid integer"),
    ({"name": "x", "maybe": {"n": 2.0}}, "maybe.n", "Input should be a valid integer"),
    ({"name": "x", "maybe": [1]}, "maybe", "Input should be a valid dictionary or instance of Inner"),
    ({"name": "x", "items": [{"n": 1}, {"n": 2, "m": 1}]}, "items.1.m", "Extra inputs are not permitted"),
    ({"name": "x", "items": {"n": 1}}, "items", "Input should be a valid list"),
    ({"name": "x", "table": {"a": 1.0, "b": None}}, "table.b", "Input should be a valid number"),
    ({"name": "x", "table": []}, "table", "Input should be a valid dictionary"),
    ([], "document", "Input should be a valid dictionary or instance of Outer"),
])
def test_what_does_not_fit_is_refused_at_its_path(document: Any, where: str, message: str) -> None:
    with pytest.raises(RecordError) as caught:
        Outer.model_validate(document)
    assert (".".join(map(str, caught.value.loc)) or "document", caught.value.msg) == (where, message)
    assert caught.value.errors() == [{"loc": caught.value.loc, "msg": message}]


def test_json_numbers_fit_their_fields_and_defaults_are_fresh() -> None:
    a = Outer.model_validate_json('{"name": "x", "ratio": 2, "table": {"t": 3}, "anything": {"k": [1]}}')
    assert a.ratio == 2.0 and type(a.ratio) is float and a.table == {"t": 3.0} and type(a.table["t"]) is float
    b = Outer(name="y")
    assert b.items == [] and b.items is not Outer(name="z").items and b.kind == "a"


@pytest.mark.parametrize("data", [b"{", b"[" * 100000, b"\xff", b"", b"null"])
def test_broken_json_is_a_record_error(data: bytes) -> None:
    with pytest.raises(RecordError):
        Outer.model_validate_json(data)


def test_records_are_frozen_and_copies_are_checked() -> None:
    a = Outer(name="x", maybe=Inner(n=2))
    with pytest.raises(AttributeError):
        a.name = "y"  # type: ignore[misc]
    assert a.model_copy(update={"name": "y"}).name == "y" and a.name == "x"
    with pytest.raises(RecordError, match="maybe.n: Input should be less than or equal to 3"):
        a.model_copy(update={"maybe": {"n": 9}})
    with pytest.raises(RecordError, match="Value error, gpu_uuids must name"):  # a whole-record check
        Manifest.model_validate({**WRITTEN["manifest"], "tensor_parallel_size": 2,
                                 "gpu_uuids": ["GPU-0123abcd-0000-1111-2222-333344445555"]})


def test_the_control_files_are_refused_in_one_line_naming_the_field(tmp_path: Path) -> None:
    control.ensure_private_dir(tmp_path / "c")
    control.write_atomic(tmp_path / "c", control.STATUS, b'{"state": "serving", "times": {"x": "1"}}')
    with pytest.raises(Exception, match=r"malformed \(times.x: Input should be a valid number\)"):
        control.read_message(tmp_path / "c", control.STATUS, control.Status)


def test_a_restore_command_imports_no_pydantic() -> None:
    probe = "import sys, vsnap.cli, vsnap._restore; print(sorted(m for m in sys.modules if m.startswith('pydantic')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class Bounded(Record):
    x: float = field(default=0.0, ge=0, le=10)
    spec: Any = None
    items: list[str] = field(default_factory=list)


@pytest.mark.parametrize("text,where,message", [
    ('{"x": 1' + "0" * 400 + "}", "x", "Input should be a finite number"),  # float() of it overflows
    ('{"x": NaN}', "x", "Input should be greater than or equal to 0"),  # NaN is within no bounds
    ('{"spec": ' + "[" * 250 + "]" * 250 + "}", "spec", "Input is nested deeper than 200 levels"),
    ('{"spec": {"a": "\\ud800"}}', "spec", "Input should be a valid string (a lone surrogate)"),
    ('{"items": ["ok", "\\udc80"]}', "items.1", "Input should be a valid string (a lone surrogate)"),
])
def test_hostile_values_are_record_errors_not_crashes(text: str, where: str, message: str) -> None:
    with pytest.raises(RecordError) as caught:
        Bounded.model_validate_json(text)
    assert (caught.value.where, caught.value.msg) == (where, message)


@pytest.mark.parametrize("data", ['{"x": 1.0}'.encode("utf-16"), '{"x": 1.0}'.encode("utf-32"),
                                  b"\xef\xbb\xbf" + b'{"x": 1.0}', "\ufeff" + '{"x": 1.0}'])
def test_only_utf8_json_without_a_byte_order_mark_is_read(data: bytes | str) -> None:
    assert Bounded.model_validate_json(b'{"x": 1.0}').x == 1.0
    with pytest.raises(RecordError, match="Invalid JSON"):
        Bounded.model_validate_json(data)


def test_a_record_keeps_its_own_containers() -> None:
    items = ["a"]
    times: dict[str, float] = {}
    b = Bounded(items=items)
    s = control.Status(state="recovering", times=times)
    items.append("b")
    times["x"] = 1.0
    assert b.items == ["a"] and s.times == {}  # what was checked stays as it was checked


def test_a_copy_with_an_unknown_field_is_a_record_error() -> None:
    with pytest.raises(RecordError, match="nope: Extra inputs are not permitted"):
        control.Status(state="serving").model_copy(update={"nope": 1})


def test_a_hostile_key_is_shown_cut_and_on_one_line() -> None:
    key = "a\nFAKE: all good\n" + "x" * 300
    with pytest.raises(RecordError) as caught:
        Outer.model_validate({"name": "x", key: 1})
    assert "\n" not in caught.value.where and len(caught.value.where) < 60 and caught.value.where.startswith("'a\\n")


@pytest.mark.parametrize("field_name,value", [("pid", 0), ("pid", (1 << 22) + 1), ("start_time", -1)])
def test_a_process_record_names_a_real_pid(field_name: str, value: int) -> None:
    from vsnap._instances import ProcessRef

    document = {"pid": 10, "start_time": 1, "boot_id": "b", field_name: value}
    with pytest.raises(RecordError, match=field_name):
        ProcessRef.model_validate(document)


@pytest.mark.parametrize("change", [{"gpu_memory_required": 10 ** 400}, {"cuda_processes": -1},
                                    {"files": {"a": {"size": -5, "digest": "d", "scheme": "sha256"}}}])
def test_the_manifest_bounds_its_sizes_and_counts(change: dict[str, Any]) -> None:
    with pytest.raises(RecordError):
        Manifest.model_validate({**WRITTEN["manifest"], **change})
