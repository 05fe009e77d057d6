"""Write a random-weight Llama that vLLM loads: config.json, safetensors shards, a byte-level BPE
tokenizer, tokenizer_config.json, generation_config.json. No model hub is needed.

    python scripts/make_test_model.py OUT_DIR [--shape tiny|tiny-hd48|8b] [--seed 0]

tiny: 2 layers, hidden 256, 4 heads of 64 (a few MB). tiny-hd48: the same with hidden 96 and 2
heads of 48, a head size vLLM's CPU attention refuses (what tests of that rule need). 8b: the
Llama-3-8B shape (32 layers, hidden 4096, 128256 vocabulary, about 15 GB in bf16). Weights are
N(0, 0.02) from a seeded generator, so the same command writes the same files.
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
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
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


def tensors(cfg: dict, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head

    def rand(*shape: int):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    yield "model.embed_tokens.weight", rand(v, h)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
        yield p + "self_attn.q_proj.weight", rand(h, h)
        yield p + "self_attn.k_proj.weight", rand(kv, h)
        yield p + "self_attn.v_proj.weight", rand(kv, h)
        yield p + "self_attn.o_proj.weight", rand(h, h)
        yield p + "post_attention_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
        yield p + "mlp.gate_proj.weight", rand(i, h)
        yield p + "mlp.up_proj.weight", rand(i, h)
        yield p + "mlp.down_proj.weight", rand(h, i)
    yield "model.norm.weight", torch.ones(h, dtype=torch.bfloat16)
    yield "lm_head.weight", rand(v, h)


def write_weights(out: Path, cfg: dict, seed: int) -> int:
    from safetensors.torch import save_file

    shards: list[dict] = [{}]
    size = 0
    for name, tensor in tensors(cfg, seed):
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    index: dict[str, str] = {}
    total = 0
    for n, shard in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        index.update({name: file for name in shard})
        shards[n - 1] = {}  # free memory as we go
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2))
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out: Path = args.out
    if (out / "config.json").exists():
        print(f"{out} already holds a model")
        return
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = dict(SHAPES[args.shape])
    write_tokenizer(tmp, cfg["vocab_size"])
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "attention_bias": False, "mlp_bias": False,
        "initializer_range": 0.02, **cfg,
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}, indent=2))
    total = write_weights(tmp, cfg, args.seed)
    os.rename(tmp, out)
    print(f"wrote {args.shape} Llama to {out}: {total / 1e9:.2f} GB of weights")


if __name__ == "__main__":
    main()
