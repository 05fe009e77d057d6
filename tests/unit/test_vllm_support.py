"""What vsnap says about a vLLM configuration beyond a dense model, without vLLM: the support
classification, the rehearsal's account of state that did not come back, LoRA adapter names."""

from types import SimpleNamespace

from vsnap.engine.adapters.vllm.adapter import RehearsalMismatch, changed_state
from vsnap.engine.adapters.vllm.config_rules import configuration_support
from vsnap.ops.bench.outputs import lora_adapter_names
from vsnap.protocol.errors import OracleMismatch
from vsnap.protocol.oracle import Oracle, OracleSample


def _config(**model: object) -> SimpleNamespace:
    fields = {"quantization": None, "is_moe": False, "is_hybrid": False, "architectures": ["LlamaForCausalLM"],
              **model}
    return SimpleNamespace(model_config=SimpleNamespace(**fields), lora_config=None, speculative_config=None)


def test_support_names_tested_and_trusted_features() -> None:
    assert configuration_support(_config()) == []
    tp2 = _config()
    tp2.parallel_config = SimpleNamespace(tensor_parallel_size=2)
    assert configuration_support(tp2) == [
        ("tensor parallelism over 2 GPUs (NCCL and CUDA graphs rebuilt at every restore)", "on trust")]
    assert configuration_support(_config(quantization="fp8")) == [("quantization fp8", "tested")]
    assert configuration_support(_config(quantization="awq")) == [("quantization awq", "on trust")]
    assert configuration_support(_config(is_moe=True, architectures=["Qwen3MoeForCausalLM"])) == [
        ("mixture of experts (Qwen3MoeForCausalLM)", "on trust")]
    config = _config(is_moe=True, architectures=["MixtralForCausalLM"], is_hybrid=True)
    config.lora_config = object()
    config.speculative_config = SimpleNamespace(method="eagle3")
    assert configuration_support(config) == [
        ("mixture of experts (MixtralForCausalLM)", "tested"), ("LoRA adapters", "tested"),
        ("speculative decoding (eagle3)", "on trust"), ("hybrid attention + state-space model", "on trust")]


def test_rehearsal_mismatch_names_what_did_not_come_back() -> None:
    before = {"parameter w": 1, "parameter b": 2, "tensor tensor@0x0": 3, "buffer cos": 4}
    after = {"parameter w": 1, "parameter b": 9, "buffer cos": 4}
    changed = changed_state(before, after)
    assert changed == ["parameter b", "tensor tensor@0x0"]
    error = RehearsalMismatch(OracleMismatch(0, 3, "token 5", "token 7"), changed, "file")
    assert str(error) == error.message == (
        "the rehearsal's oracle differs (prompt 0, token 3: expected token 5, got token 7); after sleep and the "
        "weights file, these did not come back: parameter b, tensor tensor@0x0")
    many = RehearsalMismatch(OracleMismatch(1, 0, "a", "b"), [f"parameter p{i}" for i in range(6)], "model")
    assert many.message.endswith("vLLM's reload from the model's files, these did not come back: "
                                 "parameter p0, parameter p1, parameter p2, parameter p3 and 2 more")
    none = RehearsalMismatch(OracleMismatch(0, 0, "a", "b"), [], "file")
    assert "came back: the state that differs is held outside them" in none.message


def test_lora_adapter_names_in_both_of_vllms_forms() -> None:
    assert lora_adapter_names({}) == []
    assert lora_adapter_names({"lora_modules": ["a1=/m/a1", '{"name": "a2", "path": "/m/a2"}',
                                                {"name": "a3", "path": "/m/a3"}]}) == ["a1", "a2", "a3"]
    assert lora_adapter_names({"lora-modules": "solo=/m/s"}) == ["solo"]


def test_an_oracle_sample_names_the_adapter_it_asked() -> None:
    plain = OracleSample(prompt="p", token_ids=[1], logprobs=[{"1": -0.1}])
    assert plain.model is None  # images written before adapters were asked read the same
    through = OracleSample(prompt="p", model="a1", token_ids=[1], logprobs=[{"1": -0.1}])
    assert Oracle.model_validate_json(Oracle(samples=[plain, through]).model_dump_json()).samples[1].model == "a1"


def test_an_oracle_mismatch_names_the_adapter() -> None:
    import pytest

    from vsnap.protocol.oracle import compare_oracles

    want = Oracle(samples=[OracleSample(prompt="p", model="a1", token_ids=[1, 2], logprobs=[{"1": -0.1}, {"2": -0.2}])])
    got = Oracle(samples=[OracleSample(prompt="p", model="a1", token_ids=[1, 3], logprobs=[{"1": -0.1}, {"3": -0.2}])])
    with pytest.raises(OracleMismatch, match=r"prompt 0, token 1: expected token 2 \(through a1\), got token 3"):
        compare_oracles(want, got, 0.001)
    other = Oracle(samples=[OracleSample(prompt="p", token_ids=[1, 2], logprobs=[{"1": -0.1}, {"2": -0.2}])])
    with pytest.raises(OracleMismatch, match="expected a sample through a1, got one through the model"):
        compare_oracles(want, other, 0.001)


def _compressed(weights: dict, activations: object = None, **quant: object) -> SimpleNamespace:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations, "output_activations": None}
    config = _config(quantization="compressed-tensors")
    config.model_config.hf_config = SimpleNamespace(quantization_config={
        "quant_method": "compressed-tensors", "config_groups": {"group_0": group}, "kv_cache_scheme": None, **quant})
    return config


def test_compressed_tensors_fp8_per_channel_is_tested_and_other_schemes_on_trust() -> None:
    """The scheme the 70B-class record and 0.33's families ran (make_test_model.py --fp8 channel);
    int4 weights, block or tensor scales, static activations, a KV-cache scheme stay on trust."""
    fp8 = {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False}
    dynamic = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    tested = [("quantization compressed-tensors (FP8 weights per channel)", "tested")]
    trusted = [("quantization compressed-tensors", "on trust")]
    assert configuration_support(_compressed(fp8, dynamic)) == tested
    assert configuration_support(_compressed(fp8)) == tested  # weight-only
    assert configuration_support(_compressed({**fp8, "num_bits": 4, "type": "int"}, dynamic)) == trusted
    assert configuration_support(_compressed({**fp8, "strategy": "block"}, dynamic)) == trusted
    assert configuration_support(_compressed(fp8, {**dynamic, "dynamic": False})) == trusted
    assert configuration_support(_compressed(fp8, dynamic, kv_cache_scheme={"num_bits": 8})) == trusted
    no_config = _config(quantization="compressed-tensors")
    assert configuration_support(no_config) == trusted  # no hf_config to read: on trust
