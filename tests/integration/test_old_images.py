"""An image carries the engine's code in its memory. One captured by an older vsnap restores under
a newer one, whose modules may have moved (the rooms of session 12 moved every one), only if the
restored tree imports no vsnap module after activation: this test takes the package away from the
tree between capture and restore, and the restore must still recover, prove its oracle and serve."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.integration.conftest import write_spec
from tests.integration.test_cpu_roundtrip import assert_serves_oracle, complete
from vsnap import capture_image, load_spec, restore_image, stop_server
from vsnap.ops import tree

pytestmark = pytest.mark.criu


def test_a_restored_tree_imports_no_vsnap_module_after_activation(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "captured-src"
    shutil.copytree(tree.PACKAGE_ROOT / "vsnap", copy / "vsnap", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(tree, "PACKAGE_ROOT", copy)  # the tree imports vsnap from the copy, first on its path
    result = capture_image(load_spec(write_spec(tmp_path, "old-image")))
    shutil.rmtree(copy)  # the tree's vsnap.__path__ now leads nowhere: any later import of ours fails
    server = restore_image(result.image_dir, port=0)
    try:
        assert_serves_oracle(server.url, result.manifest.oracle, result.manifest.launch.oracle_top_k)
        assert complete(server.url, "a prompt the oracle never asked", 4, 2)["token_ids"]
        log = server.engine_log.read_text(errors="replace")
        assert "ModuleNotFoundError" not in log and "ImportError" not in log
    finally:
        stop_server(server)
