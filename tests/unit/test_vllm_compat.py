"""The one seam between vLLM versions (engine/adapters/vllm/compat.py), without vLLM: a name is
taken from the newest home this vLLM has, a home that exists but fails to import is an error, and
the cumem allocator's pools are kept in the shape this vLLM uses. tests/vllm runs the real homes
on 0.26, 0.32 and 0.33."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

from vsnap.engine.adapters.vllm import compat


@pytest.fixture
def homes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Packages on sys.path: older.mod (the oldest home), broken.mod (a home whose import fails)."""
    for package, body in (("vsnap_t_older", "make_arg_parser = 'older'\n"),
                          ("vsnap_t_broken", "import vsnap_t_not_installed\n")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "mod.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    newest = ModuleType("vsnap_t_newest")
    newest.make_arg_parser = "newest"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vsnap_t_newest", newest)
    return tmp_path


def test_the_newest_home_this_vllm_has_wins(homes: Path) -> None:
    assert compat._module(("vsnap_t_newest", "vsnap_t_older.mod")).make_arg_parser == "newest"
    assert compat._module(("vsnap_t_absent.mod", "vsnap_t_older.mod")).make_arg_parser == "older"
    assert compat._module(("vsnap_t_absent.mod", "vsnap_t_newest", "vsnap_t_older.mod")).make_arg_parser == "newest"
    assert compat._module(("vsnap_t_older.absent", "vsnap_t_older.mod")).make_arg_parser == "older"


def test_a_home_that_exists_but_fails_to_import_is_an_error(homes: Path) -> None:
    with pytest.raises(ModuleNotFoundError, match="vsnap_t_not_installed"):
        compat._module(("vsnap_t_broken.mod", "vsnap_t_older.mod"))
    with pytest.raises(ModuleNotFoundError):  # no home at all: the last one's own error
        compat._module(("vsnap_t_absent.mod", "vsnap_t_absent_too.mod"))


def test_every_name_has_its_homes_newest_first() -> None:
    assert compat._HOMES["make_arg_parser"] == (
        "vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args")
    assert all(len(homes) >= 2 for homes in compat._HOMES.values())


class _Allocator:
    """CuMemAllocator's pools, as vLLM keeps them."""

    def __init__(self, pools: dict) -> None:
        self.allocator_and_pools = pools


def test_keep_pool_writes_the_shape_of_this_vllms_allocator() -> None:
    newer = _Allocator({"weights": [("pool", "plug")]})  # 0.32, 0.33: a list of pairs per tag
    compat.keep_pool(newer, "vsnap_cudagraph_pool", "p", "a")
    assert newer.allocator_and_pools["vsnap_cudagraph_pool"] == [("p", "a")]
    assert [e for es in newer.allocator_and_pools.values() for e in es][-1] == ("p", "a")  # as 0.33 releases them
    older = _Allocator({"weights": ("pool", "plug")})  # 0.26: one pair
    compat.keep_pool(older, "vsnap_cudagraph_pool", "p", "a")
    assert older.allocator_and_pools["vsnap_cudagraph_pool"] == ("p", "a")
