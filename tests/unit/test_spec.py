import os
import time
from pathlib import Path

import pytest

from vsnap.protocol.errors import SpecError
from vsnap.spec.schema import MAX_DEPTH, MAX_NODES, MAX_SPEC_BYTES, load_spec

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
    assert found == [f"{tmp_path}/model.yaml:2:1 model: engine vllm needs 'model': the directory of the model's files"]


def test_cpu_serve_args_checked(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: a\nengine: cpu\nserve:\n  tensor_parallel_size: 2\n")
    assert found == [f"{tmp_path}/model.yaml:4:3 serve.tensor_parallel_size: not understood by the cpu engine "
                     "(it takes max_model_len, seed, served_model_name)"]
    found = issues(tmp_path, "name: a\nengine: cpu\nserve:\n  max_model_len: 99999999\n")
    assert "serve.max_model_len: must be an integer from 16 to 4096 for the cpu engine" in found[0]


def test_not_yaml_and_not_mapping(tmp_path: Path) -> None:
    assert "not valid YAML" in issues(tmp_path, "name: [unclosed\n")[0]
    assert "must be a mapping" in issues(tmp_path, "- a\n- b\n")[0]
    with pytest.raises(SpecError, match="file not found"):
        load_spec(tmp_path / "absent.yaml")


# --- bounded input -----------------------------------------------------------------------------

BILLION_LAUGHS = """\
name: &a lol
engine: cpu
serve:
  b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
  c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
  d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
  e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
  f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
  g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
  h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
  i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
  j: &j [*i, *i, *i, *i, *i, *i, *i, *i, *i]
"""


def test_billion_laughs_refused_at_the_first_anchor_at_once(tmp_path: Path) -> None:
    start = time.monotonic()
    found = issues(tmp_path, BILLION_LAUGHS)
    assert time.monotonic() - start < 2
    assert found == [f"{tmp_path}/model.yaml:1:7 YAML anchors (&a) are not allowed in a model.yaml; "
                     "write the value out where it is used"]


def test_aliases_refused_at_their_position(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: a\nengine: cpu\noracle:\n  prompts: [x, *p]\n")
    assert found == [f"{tmp_path}/model.yaml:4:16 YAML aliases (*p) are not allowed in a model.yaml; "
                     "write the value out"]
    found = issues(tmp_path, "name: a\nengine: cpu\nserve:\n  seed: &s 1\n")
    assert found[0].startswith(f"{tmp_path}/model.yaml:4:9 YAML anchors (&s)")


@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, "{a: " * 3000 + "1" + "}" * 3000])
def test_nesting_is_bounded_without_recursion_error(tmp_path: Path, value: str) -> None:
    found = issues(tmp_path, f"name: a\nengine: cpu\nserve:\n  x: {value}\n")
    assert len(found) == 1 and f"nested deeper than {MAX_DEPTH} levels" in found[0]
    assert found[0].startswith(f"{tmp_path}/model.yaml:4:")


def test_block_nesting_is_bounded(tmp_path: Path) -> None:
    deep = "".join("  " * i + "a:\n" for i in range(MAX_DEPTH + 5))
    found = issues(tmp_path, "name: a\nengine: cpu\nserve:\n" + "\n".join("  " + line for line in deep.splitlines()))
    assert len(found) == 1 and "nested deeper than" in found[0]


def test_number_of_values_is_bounded(tmp_path: Path) -> None:
    start = time.monotonic()
    found = issues(tmp_path, "name: a\nengine: cpu\nserve:\n  x: [" + "1," * (MAX_NODES + 10) + "1]\n")
    assert time.monotonic() - start < 5  # 25 s before the bound
    assert len(found) == 1 and f"more than {MAX_NODES} values" in found[0]


def test_values_that_are_not_plain_data_are_refused_at_their_line(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: !foo a\nengine: cpu\nserve:\n  seed: 2001-12-14\n  x: !!binary aGVsbG8=\n"
                             "oracle:\n  top_k: " + "7" * 5000 + "\n  tolerance: .inf\n  prompts: !!set {a, b}\n")
    file = f"{tmp_path}/model.yaml"
    values = "values are strings, numbers, true/false or null"
    assert found == [
        f"{file}:1:7 name: tag !foo is not allowed; {values}",
        f"{file}:4:9 serve.seed: a date or time (quote it to make it a string) is not allowed; {values}",
        # the rule on the key is reported beside its refused value; nothing more for the values refused
        f"{file}:5:3 serve.x: not understood by the cpu engine (it takes max_model_len, seed, served_model_name)",
        f"{file}:5:6 serve.x: binary data is not allowed; {values}",
        f"{file}:7:10 oracle.top_k: cannot be read as int (more than 4300 digits)",
        f"{file}:8:14 oracle.tolerance: must be a finite number",
        f"{file}:9:12 oracle.prompts: tag tag:yaml.org,2002:set is not allowed here",
    ]


def test_keys_must_be_plain_strings(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: a\nengine: cpu\n1: x\n<<: {a: 1}\n")
    assert found == [f"{tmp_path}/model.yaml:3:1 keys must be plain strings",
                     f"{tmp_path}/model.yaml:4:1 keys must be plain strings, not a merge key (<<)"]


def test_control_characters_and_encoding_located(tmp_path: Path) -> None:
    path = tmp_path / "model.yaml"
    path.write_bytes(b"name: a\nengine: cpu\x00\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [str(i) for i in info.value.issues] == [f"{path}:2:12 not valid YAML: character #x0000 is not allowed"]
    path.write_bytes(b"name: a\nengine: \xff\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [str(i) for i in info.value.issues] == [f"{path}:2 is not UTF-8 text (byte 16)"]


def test_only_regular_files_of_bounded_size_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # reading it would block forever
    for path in (fifo, Path("/dev/zero"), tmp_path):  # /dev/zero would never end
        with pytest.raises(SpecError, match="is not a regular file"):
            load_spec(path)
    big = tmp_path / "big.yaml"
    big.write_text("name: a\n" + "#" * MAX_SPEC_BYTES)
    with pytest.raises(SpecError, match=f"larger than {MAX_SPEC_BYTES} bytes"):
        load_spec(big)


# --- every error, each at its own line ------------------------------------------------------


def test_every_error_reported_each_at_its_own_line(tmp_path: Path) -> None:
    found = issues(tmp_path, f"name: a\nengine: cpu\nmodel: {tmp_path}/nowhere\nserve:\n  foo: 1\n"
                             "  max-model-len: 3\n  max_model_len: 20\n  seed: x\noracle:\n  top_k: 99\n")
    file = f"{tmp_path}/model.yaml"
    assert found == [
        f"{file}:3:1 model: {tmp_path}/nowhere does not exist",
        f"{file}:5:3 serve.foo: not understood by the cpu engine (it takes max_model_len, seed, served_model_name)",
        f"{file}:6:3 serve.max-model-len: must be an integer from 16 to 4096 for the cpu engine",
        f"{file}:7:3 serve.max_model_len: given twice (also as max-model-len)",
        f"{file}:8:3 serve.seed: must be an integer",
        f"{file}:10:3 oracle.top_k: Input should be less than or equal to 20",
    ]


def test_engine_rule_reported_beside_field_errors(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: a\nengine: vllm\noracle:\n  max_tokens: many\n")
    assert found[0] == f"{tmp_path}/model.yaml:2:1 model: engine vllm needs 'model': the directory of the model's files"
    assert found[1].startswith(f"{tmp_path}/model.yaml:4:3 oracle.max_tokens: Input should be a valid integer")


def test_serve_argument_names_located_at_their_key(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: a\nengine: vllm\nmodel: /nowhere\nserve:\n  dtype: half\n  Bad Name: 1\n")
    assert f"{tmp_path}/model.yaml:6:3 serve.Bad Name: 'Bad Name' is not an argument name" in found[-1]


def test_spec_error_lists_every_issue_in_json(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, "name: a\nengine: cpu\nserve:\n  x: 1\n  y: 2\n"))
    doc = info.value.to_dict()
    assert [(i["line"], i["field"]) for i in doc["issues"]] == [(4, "serve.x"), (5, "serve.y")]


def test_locate_finds_a_key_of_the_loaded_spec(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, "name: a\nengine: cpu\nserve:\n  seed: 3\n"))
    assert spec.locate("serve", "seed") == (f"{tmp_path}/model.yaml", 4, 3)


# --- system paths --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/boot", "/dev", "/proc",
                                  "/sys", "/run", "/var", "/var/lib", "/home", "/root", "/tmp", "/var/tmp", "/opt",
                                  "/etc/", "//etc", "/etc/vsnap/img", "/usr/local/images", "/proc/1/root",
                                  "/sys/fs/x", "/dev/shm", "/dev/shm/img", "/boot/img", "/home/alice",
                                  "/var/lib/vsnap/images", "/run/vsnap"])
def test_system_directories_refused_as_image(tmp_path: Path, path: str) -> None:
    found = issues(tmp_path, f"name: a\nengine: cpu\nimage: {path}\n")
    assert len(found) == 1 and found[0].startswith(f"{tmp_path}/model.yaml:3:1 image: ")
    assert "system directory" in found[0] or "home directory" in found[0]
    assert "the image must be a directory of its own" in found[0] and "/var/lib/vsnap/images/NAME" in found[0]


@pytest.mark.parametrize("path", ["/", "/run", "/var/run", "/etc/vsnap", "/proc/self", "/dev/shm", "/tmp"])
def test_system_directories_refused_as_control_dir(tmp_path: Path, path: str) -> None:
    found = issues(tmp_path, f"name: a\nengine: cpu\nsnapshot:\n  control_dir: {path}\n")
    assert len(found) == 1 and found[0].startswith(f"{tmp_path}/model.yaml:4:3 snapshot.control_dir: ")
    assert "the control directory must be a directory of its own" in found[0]


@pytest.mark.parametrize("path", ["/var/lib/vsnap/images/a", "/srv/vsnap/a", "/home/alice/images/a", "/tmp/x/a",
                                  "/root/images/a", "/opt/vsnap/a"])
def test_ordinary_directories_accepted(tmp_path: Path, path: str) -> None:
    assert load_spec(write(tmp_path, f"name: a\nengine: cpu\nimage: {path}\n")).image_dir == Path(path)


def test_a_symlink_to_a_system_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to("/etc")
    found = issues(tmp_path, f"name: a\nengine: cpu\nimage: {tmp_path}/link/img\n")
    assert f"{tmp_path}/link/img resolves to /etc/img through a symlink, and /etc/img is inside /etc" in found[0]


def test_image_control_dir_and_model_kept_apart(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    found = issues(tmp_path, f"name: a\nengine: cpu\nimage: {tmp_path}/c\nsnapshot:\n  control_dir: {tmp_path}/c\n")
    assert f":3:1 image: {tmp_path}/c and the control directory {tmp_path}/c overlap" in found[0]
    found = issues(tmp_path, f"name: a\nengine: cpu\nimage: {tmp_path}/c.instances/x\nsnapshot:\n"
                             f"  control_dir: {tmp_path}/c\n")
    assert "overlap" in found[0]
    found = issues(tmp_path, f"name: a\nengine: cpu\nmodel: {model}\nimage: {tmp_path}\n")
    assert found == [f"{tmp_path}/model.yaml:4:1 image: {tmp_path} holds the model {model}; a capture with --force "
                     "would delete it: put the image elsewhere"]


def test_control_dir_never_the_instance_registry(tmp_path: Path) -> None:
    found = issues(tmp_path, "name: instances\nengine: cpu\n")
    assert found[0].startswith(f"{tmp_path}/model.yaml:1:1 snapshot.control_dir: /run/vsnap/instances would hold "
                               "vsnap's registry of running instances")


@pytest.mark.parametrize("path,what", [("/run/vsnap/instances", "registry of running instances"),
                                       ("/run/vsnap/captures/x", "records of running captures"),
                                       ("/run/vsnap/verified", "cache of verified image files")])
def test_image_never_holds_vsnap_state(tmp_path: Path, path: str, what: str) -> None:
    found = issues(tmp_path, f"name: a\nengine: cpu\nimage: {path}\n")
    assert found == [f"{tmp_path}/model.yaml:3:1 image: {path} would hold vsnap's {what} "
                     f"({path.removesuffix('/x')}); choose another image (or name)"]


def test_path_characters(tmp_path: Path) -> None:
    found = issues(tmp_path, 'name: a\nengine: cpu\nimage: "/srv/a\\nb"\nsnapshot:\n  control_dir: "/srv/c]:m0"\n')
    assert "image: image must not contain control characters" in found[0]
    assert "snapshot.control_dir: control_dir may hold only letters, digits" in found[1] and "':]'" in found[1]


def test_command_line_overrides_pass_the_same_checks(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, "name: a\nengine: cpu\nimage: /srv/a\n"), overrides={"image": "/etc"})
    [issue] = info.value.issues
    assert issue.line is None and issue.field == "image"
    assert issue.message.startswith("/etc is a system directory") and issue.message.endswith(
        "(given on the command line)")


def test_python_construction_checks_the_same_rules() -> None:
    from pydantic import ValidationError

    from vsnap.spec.schema import ModelSpec

    for kwargs, text in [({"image": "/etc"}, "/etc is a system directory"),
                         ({"engine": "vllm"}, "engine vllm needs 'model'"),
                         ({"serve": {"tensor_parallel_size": 2}}, "not understood by the cpu engine"),
                         ({"serve": {"seed": 1, "max-model-len": 20, "max_model_len": 30}}, "given twice")]:
        with pytest.raises(ValidationError, match=text):
            ModelSpec(**{"name": "a", "engine": "cpu", **kwargs})


def test_vllm_cpu_example_loads(tmp_path: Path) -> None:
    """examples/vllm-cpu.yaml (make demo, the vLLM CPU bench record): its model is written by the
    demo, so here it points at a stand-in directory; the rest is the file as shipped."""
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text("{}")
    text = (ROOT / "examples" / "vllm-cpu.yaml").read_text()
    assert "model: /var/lib/vsnap/models/tiny-llama\n" in text
    spec = load_spec(write(tmp_path, text.replace("/var/lib/vsnap/models/tiny-llama", str(model))))
    assert spec.engine == "vllm" and spec.image_dir == Path("/var/lib/vsnap/images/demo-vllm-cpu")
    assert spec.serve == {"max_model_len": 512, "enforce_eager": True, "kv_cache_memory_bytes": 1 << 20}


def test_an_oracle_too_large_for_the_manifest_is_refused_at_its_line(tmp_path: Path) -> None:
    prompts = ", ".join(f'"p{i}"' for i in range(64))
    at_bound = f"name: o\nengine: cpu\noracle:\n  prompts: [{prompts}]\n  max_tokens: 97\n  top_k: 20\n"
    assert load_spec(write(tmp_path, at_bound)).oracle.max_tokens == 97  # 64 x 97 x 21 = 130368
    [issue] = issues(tmp_path, at_bound.replace("max_tokens: 97", "max_tokens: 98"))
    assert ":3:1 oracle: prompts x max_tokens x (top_k + 1) = 131712 logprobs" in issue
    assert "at most 131072 fit in an image's manifest" in issue
