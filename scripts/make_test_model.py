"""Write a random-weight model that vLLM loads: config.json, safetensors shards, a byte-level BPE
tokenizer, tokenizer_config.json, generation_config.json. No model hub is needed.

    python scripts/make_test_model.py OUT_DIR [--shape tiny|tiny-hd48|tiny-moe|8b|70b] [--fp8 [tensor|channel]]
                                      [--layers N] [--seed 0] [--device auto|cpu|cuda]
    python scripts/make_test_model.py OUT_DIR --adapter [--shape tiny] [--seed 1]

tiny: a Llama of 2 layers, hidden 256, 4 heads of 64 (a few MB). tiny-hd48: the same with hidden
96 and 2 heads of 48, a head size vLLM's CPU attention refuses (what tests of that rule need).
tiny-moe: a Mixtral of the tiny size with 4 experts, top-2 routing. 8b: the Llama-3-8B shape (32
layers, hidden 4096, 128256 vocabulary, about 15 GB in bf16). 70b: the Llama-3-70B shape (80
layers, hidden 8192, 64 heads, 8 KV heads, intermediate 28672, 128256 vocabulary; about 141 GB in
bf16, 72.7 GB with --fp8). --fp8 (or --fp8 tensor): the linear layers' weights stored in
float8_e4m3fn with a per-tensor float32 scale (vLLM's own "fp8" checkpoint format, dynamic
activation scales). --fp8 channel: a bfloat16 scale per output channel instead, in the
compressed-tensors format ("float-quantized", weights strategy "channel", activations dynamic per
token, lm_head left in bf16) that most published FP8 checkpoints use. --adapter: a PEFT LoRA
adapter (rank 8, every projection) for that shape instead of a model. Weights are N(0, 0.02) from
a seeded generator, so the same command writes the same files on the same kind of device;
--device auto makes them on the GPU when there is one (the CPU generator would take many minutes
for 70 GB). --layers N: the shape with N layers instead of its own (every layer of these shapes is
alike, so a few layers of the 70B on a CPU say per layer what the whole model holds;
scripts/reference_share.py uses that).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048),
    "tiny-hd48": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048),
    "tiny-moe": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048,
                     num_local_experts=4, num_experts_per_tok=2),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
}
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987",
    "Snapshots let a server start in a second instead of a minute.",
]
SHARD_BYTES = 2 << 30


def write_tokenizer(out: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 1024), special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 8192, "clean_up_tokenization_spaces": False,
    }, indent=2))
    return tokenizer.get_vocab_size()


def tensors(cfg: dict, seed: int, device: str = "cpu"):
    """Every tensor of the model, made on ``device`` (bf16; norms ones)."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head

    def rand(*shape: int):
        return (torch.randn(*shape, generator=generator, device=device) * 0.02).to(torch.bfloat16)

    yield "model.embed_tokens.weight", rand(v, h)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", torch.ones(h, dtype=torch.bfloat16, device=device)
        yield p + "self_attn.q_proj.weight", rand(h, h)
        yield p + "self_attn.k_proj.weight", rand(kv, h)
        yield p + "self_attn.v_proj.weight", rand(kv, h)
        yield p + "self_attn.o_proj.weight", rand(h, h)
        yield p + "post_attention_layernorm.weight", torch.ones(h, dtype=torch.bfloat16, device=device)
        if "num_local_experts" in cfg:  # Mixtral: a router and w1 (gate), w3 (up), w2 (down) per expert
            yield p + "block_sparse_moe.gate.weight", rand(cfg["num_local_experts"], h)
            for e in range(cfg["num_local_experts"]):
                yield p + f"block_sparse_moe.experts.{e}.w1.weight", rand(i, h)
                yield p + f"block_sparse_moe.experts.{e}.w3.weight", rand(i, h)
                yield p + f"block_sparse_moe.experts.{e}.w2.weight", rand(h, i)
        else:
            yield p + "mlp.gate_proj.weight", rand(i, h)
            yield p + "mlp.up_proj.weight", rand(i, h)
            yield p + "mlp.down_proj.weight", rand(h, i)
    yield "model.norm.weight", torch.ones(h, dtype=torch.bfloat16, device=device)
    yield "lm_head.weight", rand(v, h)


FP8_LINEAR = ("_proj.weight",)  # the linear layers an "fp8" checkpoint stores in float8 (not the MoE experts')


def as_fp8(named, strategy: str = "tensor"):
    """float8_e4m3fn weights with their ``weight_scale`` (448: e4m3's largest): one float32 scale
    per tensor ("tensor"), or one bfloat16 scale per output channel, shape (out, 1) ("channel");
    the weights are divided by the scale as stored (bf16-rounded), so scale x weight is the model."""
    import torch

    for name, tensor in named:
        if name.endswith(FP8_LINEAR):
            if strategy == "channel":
                scale = (tensor.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0).to(torch.bfloat16)
            else:
                scale = (tensor.float().abs().max().clamp(min=1e-12) / 448.0).reshape(())
            yield name, (tensor.float() / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            yield name.removesuffix("weight") + "weight_scale", scale
        else:
            yield name, tensor


def fp8_quantization_config(strategy: str) -> dict:
    """config.json's quantization_config for as_fp8's format."""
    if strategy == "tensor":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    numbers = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
               "actorder": None, "observer": None, "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {**numbers, "strategy": "channel", "dynamic": False, "observer": "minmax"},
                "input_activations": {**numbers, "strategy": "token", "dynamic": True},
                "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def adapter_tensors(cfg: dict, seed: int, rank: int):
    """A PEFT LoRA adapter's A and B matrices for every projection of every layer."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            p = f"base_model.model.model.layers.{layer}.{module}."
            yield p + "lora_A.weight", (torch.randn(rank, fan_in, generator=generator) * 0.05).to(torch.bfloat16)
            yield p + "lora_B.weight", (torch.randn(fan_out, rank, generator=generator) * 0.05).to(torch.bfloat16)


def write_adapter(out: Path, cfg: dict, seed: int, rank: int = 8) -> int:
    from safetensors.torch import save_file

    named = dict(adapter_tensors(cfg, seed, rank))
    save_file(named, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "base_model_name_or_path": None, "fan_in_fan_out": False,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }, indent=2))
    return sum(t.numel() * t.element_size() for t in named.values())


def write_weights(out: Path, cfg: dict, seed: int, fp8: str | None = None, device: str = "cpu") -> int:
    from safetensors.torch import save_file

    # Each shard is written as soon as it is full, under a provisional name (the count of shards is
    # known only at the end): holding every shard in host memory until the end took the whole model
    # in RAM (72.7 GB for --shape 70b --fp8, beside the same bytes in a tmpfs: more than the GPU
    # host's 128 GiB).
    written: list[tuple[Path, list[str]]] = []
    shard: dict = {}
    size = total = 0

    def flush() -> None:
        path = out / f"shard-{len(written) + 1:05d}.partial"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    named = tensors(cfg, seed, device)
    for name, tensor in as_fp8(named, fp8) if fp8 else named:
        tensor = tensor.cpu()  # made on the device, stored from host memory, a shard at a time
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard[name] = tensor
        size += nbytes
        total += nbytes
    flush()
    index: dict[str, str] = {}
    for n, (path, names) in enumerate(written, 1):
        file = f"model-{n:05d}-of-{len(written):05d}.safetensors" if len(written) > 1 else "model.safetensors"
        os.rename(path, out / file)
        index.update({name: file for name in names})
    if len(written) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2))
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp8", nargs="?", const="tensor", choices=("tensor", "channel"), default=None,
                        help="store the linear layers in float8 with a scale per tensor (default) or per channel")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the random tensors are made (auto: the GPU when there is one)")
    parser.add_argument("--adapter", action="store_true", help="write a LoRA adapter for the shape instead")
    parser.add_argument("--layers", type=int, default=None, help="this many layers instead of the shape's own")
    args = parser.parse_args()
    if args.layers is not None and not 1 <= args.layers <= 1000:
        parser.error("--layers: a number of layers from 1 to 1000")
    out: Path = args.out
    if (out / "config.json").exists() or (out / "adapter_config.json").exists():
        print(f"{out} already holds a model")
        return
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = dict(SHAPES[args.shape])
    if args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
    if args.adapter:
        total = write_adapter(tmp, cfg, args.seed)
        os.rename(tmp, out)
        print(f"wrote a LoRA adapter for {args.shape} to {out}: {total / 1e6:.2f} MB")
        return
    write_tokenizer(tmp, cfg["vocab_size"])
    moe = "num_local_experts" in cfg
    config = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama", "torch_dtype": "bfloat16",
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "attention_bias": False, "mlp_bias": False,
        "initializer_range": 0.02, **cfg,
    }
    if args.fp8:
        config["quantization_config"] = fp8_quantization_config(args.fp8)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}, indent=2))
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    total = write_weights(tmp, cfg, args.seed, fp8=args.fp8, device=device)
    os.rename(tmp, out)
    print(f"wrote {args.shape}{f' fp8 ({args.fp8})' if args.fp8 else ''} {config['architectures'][0]} to {out}: "
          f"{total / 1e9:.2f} GB of weights, made on {device}")


if __name__ == "__main__":
    main()
