from pathlib import Path

import pytest

from vsnap.protocol.errors import SpecError
from vsnap._spec import load_spec

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "model.yaml"
    path.write_text(text)
    return path


def issues(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text))
    return [str(issue) for issue in info.value.issues]


@pytest.mark.parametrize("example", ["cpu.yaml"])
def test_examples_load(example: str) -> None:
    spec = load_spec(ROOT / "examples" / example)
    assert spec.engine == "cpu"
    assert spec.image_dir == Path("/var/lib/vsnap/images/cpu-tiny")
    assert spec.oracle.top_k == 5


def test_unknown_key_names_line_and_key(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: a\nengine: cpu\nsnapshot:\n  control_dir: /tmp/x\n  timeout: 5\n")
    assert found == [f"{tmp_path}/model.yaml:5:3 snapshot.timeout: unknown key"]


def test_wrong_type_names_line(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: a\nengine: cpu\noracle:\n  max_tokens: eight\n")
    assert found[0].startswith(f"{tmp_path}/model.yaml:4:3 oracle.max_tokens: Input should be a valid integer")


def test_strict_types_refuse_coercion(tmp_path: Path) -> None:
    # YAML 1.1 would read 'yes' as true and pydantic's lax mode would turn "5" into 5
    found = issues(tmp_path, "name: a\nengine: cpu\noracle:\n  max_tokens: '5'\n  tolerance: yes\n")
    assert any("oracle.max_tokens" in f and ":4:" in f for f in found)
    assert any("oracle.tolerance" in f and ":5:" in f for f in found)


def test_all_issues_reported_at_once(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: a\nengine: gpu\nbogus: 1\n")
    assert len(found) == 2
    assert any(":2:1 engine:" in f for f in found) and any(":3:1 bogus: unknown key" in f for f in found)


def test_duplicate_key_refused(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: a\nengine: cpu\nname: b\n")
    assert found == [f"{tmp_path}/model.yaml:3:1 name: duplicate key"]


@pytest.mark.parametrize("key,value", [("image", "images/x"), ("image", "/var/../etc"), ("model", "rel/model")])
def test_paths_must_be_absolute_without_dotdot(tmp_path: Path, key: str, value: str) -> None:
    found = issues(tmp_path, f"name: a\nengine: cpu\n{key}: {value}\n")
    assert f":3:1 {key}:" in found[0] and ("absolute" in found[0] or "'..'" in found[0])


def test_control_dir_rules(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: a\nengine: cpu\nsnapshot:\n  control_dir: run/x\n  timeout_s: 0\n")
    assert any("snapshot.control_dir: control_dir must be an absolute path" in f for f in found)
    assert any(":5:3 snapshot.timeout_s: Input should be greater than 0" in f for f in found)


def test_defaults(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, "name: tiny\nengine: cpu\n"))
    assert spec.snapshot.timeout_s == 900
    assert spec.control_dir == Path("/run/vsnap/tiny")
    assert spec.served_model_name == "tiny"


def test_missing_model_path_names_line(tmp_path: Path) -> None:
    found = issues(tmp_path, f"name: a\nengine: cpu\nmodel: {tmp_path}/nowhere\n")
    assert found == [f"{tmp_path}/model.yaml:3:1 model: {tmp_path}/nowhere does not exist"]


def test_vllm_needs_model(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: a\nengine: vllm\n")
    assert "engine vllm needs 'model'" in found[0]


def test_cpu_serve_args_checked(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: a\nengine: cpu\nserve:\n  tensor_parallel_size: 2\n")
    assert "serve.tensor_parallel_size is not understood by the cpu engine" in found[0]
    found = issues(tmp_path, "name: a\nengine: cpu\nserve:\n  max_model_len: 99999999\n")
    assert "max_model_len must be an integer from 16 to 4096" in found[0]


def test_not_yaml_and_not_mapping(tmp_path: Path) -> None:
    assert "not valid YAML" in issues(tmp_path, "name: [unclosed\n")[0]
    assert "must be a mapping" in issues(tmp_path, "- a\n- b\n")[0]
    with pytest.raises(SpecError, match="file not found"):
        load_spec(tmp_path / "absent.yaml")
