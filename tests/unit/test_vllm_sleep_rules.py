"""How vLLM sleeps, in the model rules (config_rules.sleep_refusals), without vLLM: each of
SLEEP_SETTINGS away from its default is refused by name; a vLLM without the field (0.26 has only
sleep_mode_backend) reads as the default. tests/vllm runs them on real resolved configurations."""

from __future__ import annotations

from types import SimpleNamespace

from vsnap.engine.adapters.vllm.config_rules import sleep_refusals
from vsnap.engine.adapters.vllm.rules import SLEEP_SETTINGS


def test_vllms_defaults_pass_whichever_fields_it_has() -> None:
    assert sleep_refusals(SimpleNamespace()) == []
    assert sleep_refusals(SimpleNamespace(sleep_mode_backend="cumem")) == []  # 0.26
    assert sleep_refusals(SimpleNamespace(**{name: default for name, (default, _) in SLEEP_SETTINGS.items()})) == []


def test_each_setting_away_from_its_default_is_refused_in_one_line() -> None:
    model = SimpleNamespace(sleep_mode_backend="criu", sleep_mode_offload_cudagraph=True, enable_nccl_comm_suspend=True)
    refusals = sleep_refusals(model)
    assert [r.argument for r in refusals] == ["sleep_mode_backend", "sleep_mode_offload_cudagraph",
                                              "enable_nccl_comm_suspend"]
    assert all("\n" not in str(r) and str(r).endswith(")") for r in refusals)
    assert str(refusals[0]).startswith("sleep_mode_backend: vsnap sleeps and wakes the engine through vLLM's cumem")
