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

from vsnap.host.instances import CaptureRecord, InstanceRecord
from vsnap.image.manifest import Manifest
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


# Fields added since, with the value a record written without them reads as (issue 26: the CRIU
# process of a restore in flight).
ADDED_SINCE: dict[str, dict[str, Any]] = {"instance": {"criu": None, "timings": {}, "metrics_dir": ""}}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_what_pydantic_wrote_reads_the_same_and_round_trips(kind: str) -> None:
    record = KINDS[kind].model_validate_json(json.dumps(WRITTEN[kind]))
    assert record.model_dump() == {**WRITTEN[kind], **ADDED_SINCE.get(kind, {})}  # none lost, none added unnamed
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
    probe = "import sys, vsnap.cli, vsnap.ops.restore; print(sorted(m for m in sys.modules if m.startswith('pydantic')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class Bounded(Record):
    x: float = field(default=0.0, ge=0, le=10)
    spec: Any = None
    items: list[str] = field(default_factory=list)


@pytest.mark.parametrize("text,where,message", [
    ('{"x": 1' + "0" * 400 + "}", "x", "Input should be a finite number"),  # float() of it overflows
    ('{"x": NaN}', "x", "Input should be a finite number"),
    ('{"x": -Infinity}', "x", "Input should be a finite number"),
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
    from vsnap.host.instances import ProcessRef

    document = {"pid": 10, "start_time": 1, "boot_id": "b", field_name: value}
    with pytest.raises(RecordError, match=field_name):
        ProcessRef.model_validate(document)


@pytest.mark.parametrize("change", [{"gpu_memory_required": 10 ** 400}, {"cuda_processes": -1},
                                    {"files": {"a": {"size": -5, "digest": "d", "scheme": "sha256"}}}])
def test_the_manifest_bounds_its_sizes_and_counts(change: dict[str, Any]) -> None:
    with pytest.raises(RecordError):
        Manifest.model_validate({**WRITTEN["manifest"], **change})


def test_an_oracle_with_nan_reads_and_then_fails_as_a_mismatch() -> None:
    from vsnap.protocol.errors import OracleMismatch
    from vsnap.protocol.oracle import compare_oracles

    text = '{"samples": [{"prompt": "p", "token_ids": [1], "logprobs": [{"1": NaN}]}]}'
    broken = Oracle.model_validate_json(text)  # what a broken restore computes is reported, not refused
    good = Oracle.model_validate_json(text.replace("NaN", "-0.5"))
    with pytest.raises(OracleMismatch):
        compare_oracles(good, broken, 1.0)


@pytest.mark.parametrize("change,message", [
    ({"control_mount_key": "m0 --action-script /tmp/x"}, "CRIU external key"),
    ({"externals": {"m5": "/srv\u0000x"}}, "external mount point"),
    ({"dependencies": [{"path": "relative/lib.so", "size": 1}]}, "a dependency's path"),
    ({"dependencies": [{"path": "/lib/" + "x" * 5000, "size": 1}]}, "a dependency's path"),
    ({"shm_files": ["link_remap.1\u0000"]}, "file name"),
    ({"sizes": {"image_bytes": 10 ** 30}}, "64 bits"),
    ({"processes": [{"anonymous_bytes": 10 ** 30}]}, "64 bits"),
    ({"timings": {"capture_s": float("inf")}}, "finite"),
])
def test_what_the_manifest_hands_to_criu_or_the_kernel_is_plain(change: dict[str, Any], message: str) -> None:
    with pytest.raises(RecordError, match=message):
        Manifest.model_validate({**WRITTEN["manifest"], **change})


def test_a_control_file_too_large_is_refused_before_it_is_read(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    directory = control.ensure_private_dir(tmp_path / "c")
    control.write_atomic(directory, control.STATUS, b'{"state": "serving"}' + b" " * 2000)
    monkeypatch.setattr(control, "MAX_CONTROL_BYTES", 1000)
    with pytest.raises(control.ControlProtocolError, match="holds 2020 bytes"):
        control.read_message(directory, control.STATUS, control.Status)


def test_another_format_versions_message_is_printable_and_short(tmp_path: Path) -> None:
    from tests.unit import fake_image
    from vsnap.image.manifest import read_manifest
    from vsnap.protocol.errors import ImageIncompatible

    image = fake_image.make_image(tmp_path / "images" / "other", raw={"format_version": 3, "vsnap_version": "\ud800" + "v" * 500})
    with pytest.raises(ImageIncompatible) as caught:
        read_manifest(image)
    text = str(caught.value)
    text.encode("utf-8")  # no lone surrogate left to crash a terminal's encoder
    assert "\\ud800" in text and len(text) < 400
    fake_image.make_image(tmp_path / "images" / "bool", raw={"format_version": True})
    with pytest.raises(Exception, match="malformed"):  # a bool is not a format version
        read_manifest(tmp_path / "images" / "bool")


def test_a_manifest_too_large_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit import fake_image
    from vsnap.image import manifest as _manifest
    from vsnap.protocol.errors import ImageFormatError

    image = fake_image.make_image(tmp_path / "images" / "big")
    size = (image / "manifest.json").stat().st_size
    monkeypatch.setattr(_manifest, "MAX_MANIFEST_BYTES", size - 1)
    with pytest.raises(ImageFormatError, match=f"holds {size} bytes; a manifest holds at most {size - 1}"):
        _manifest.read_manifest(image)
    monkeypatch.setattr(_manifest, "MAX_MANIFEST_BYTES", size)
    assert _manifest.read_manifest(image).name == "fake"
