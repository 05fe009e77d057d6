"""The CPU engine's model: a small decoder-only transformer over bytes, stored as safetensors.

vsnap writes it deterministically (a fixed seed) when a cpu spec names no model, so every
host that writes it gets the same bytes. Generation is greedy with top-k log probabilities,
recomputing the whole sequence at each step: slow for long outputs, simple and exactly
reproducible, which is what the oracle needs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

MODEL_TYPE = "vsnap-tiny-decoder"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
BOS, EOS = 256, 257


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 258
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    max_positions: int = 4096
    seed: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TinyConfig":
        if data.get("model_type") != MODEL_TYPE:
            raise ValueError(f"config.json: model_type is {data.get('model_type')!r}, expected {MODEL_TYPE!r}")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": MODEL_TYPE, "architectures": ["VsnapTinyDecoder"], **self.__dict__}


class _Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        shape = (batch, length, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyDecoder(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.positions(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def encode(text: str) -> list[int]:
    return [BOS, *text.encode("utf-8")]


def token_text(token: int) -> str:
    """A unique printable name per token id (bytes that are not printable ASCII as <0xNN>)."""
    if token == BOS:
        return "<s>"
    if token == EOS:
        return "</s>"
    return chr(token) if 32 <= token < 127 else f"<0x{token:02X}>"


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def write_model(directory: Path, cfg: TinyConfig = TinyConfig()) -> Path:
    """Write the model (config.json + model.safetensors) into ``directory``, atomically."""
    from safetensors.torch import save_file

    directory = Path(directory)
    if (directory / CONFIG_FILE).is_file() and (directory / WEIGHTS_FILE).is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        generator = torch.Generator().manual_seed(cfg.seed)
        model = TinyDecoder(cfg)
        with torch.no_grad():
            for name, param in sorted(model.named_parameters()):
                if name.endswith("bias"):
                    param.zero_()
                elif "ln" in name:
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.08)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(staging / WEIGHTS_FILE))
        (staging / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        os.chmod(staging, 0o755)
        os.rename(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def read_config(directory: Path) -> TinyConfig:
    return TinyConfig.from_dict(json.loads((Path(directory) / CONFIG_FILE).read_text()))


def load_weights(model: TinyDecoder, directory: Path) -> int:
    """Put the weights from the safetensors file back into ``model``; return the bytes loaded."""
    from safetensors.torch import load_file

    state = load_file(str(Path(directory) / WEIGHTS_FILE))
    params = dict(model.named_parameters())
    if set(state) != set(params):
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(f"weights do not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    loaded = 0
    for name, tensor in state.items():
        params[name].data = tensor
        loaded += tensor.numel() * tensor.element_size()
    return loaded


def drop_weights(model: TinyDecoder) -> None:
    """Release the weights' memory; load_weights() brings them back."""
    for param in model.parameters():
        param.data = torch.empty(0)


@torch.no_grad()
def generate(model: TinyDecoder, prompt: str, max_tokens: int, top_k: int, max_len: int) -> dict[str, Any]:
    """Greedy decoding; returns the token ids and, per position, the top-k logprobs by token id."""
    ids = encode(prompt)
    if len(ids) + max_tokens > max_len:
        raise ValueError(f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds max_model_len {max_len}")
    tokens: list[int] = []
    logprobs: list[dict[str, float]] = []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids + tokens]))[0, -1].float()
        log_probs = torch.log_softmax(logits, dim=-1)
        values, indices = torch.topk(log_probs, top_k)
        chosen = int(indices[0])
        tokens.append(chosen)
        logprobs.append({str(int(i)): float(v) for v, i in zip(values, indices)})
    return {"token_ids": tokens, "logprobs": logprobs, "prompt_tokens": len(ids)}
