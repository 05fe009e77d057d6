"""The CPU engine's model: a small decoder-only transformer over bytes, stored as safetensors.

vsnap writes it deterministically (a fixed seed) when a cpu spec names no model, so every
host that writes it gets the same bytes. Tokens are bytes (0-255) plus BOS and EOS.

Generation is greedy with top-k log probabilities, one token per ``next_token`` call, which
recomputes the whole sequence (no KV cache): slow for long outputs, but simple and exactly
reproducible, which is what the oracle needs. Why one sequence per forward pass: a batch of
sequences of different lengths would need padding and a batched matmul whose blocking differs
from a single row's, so its logprobs need not be bit-identical to a request served alone. The
scheduler (scheduler.py) therefore interleaves sequences step by step instead of batching them
inside one forward pass; ``step`` runs several sequences one after the other in one worker call.

``generate`` is the reference answer: every way of serving a prompt (the oracle, a streamed or
a plain completion, a request scheduled among others) must give exactly its tokens and logprobs.

The chat template (``chat_prompt``) and the streaming detokenizer (``TextStream``) live here
too: like a tokenizer's, they belong to the model.
"""

from __future__ import annotations

import codecs
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
MAX_CONFIG_BYTES = 4 << 20
BOS, EOS = 256, 257


# the demo engine's model is small: these bound a config's sizes (at most ~1.6 G parameters, ~6.4 GB
# of float32 weights; its max_model_len is at most 4096)
CONFIG_LIMITS = {"vocab_size": 65536, "d_model": 1024, "n_layers": 32, "n_heads": 64, "d_ff": 4096,
                 "max_positions": 65536, "seed": (1 << 63) - 1}


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
        values = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        for key, value in values.items():  # a hostile config must not make the tree allocate without bound
            if type(value) is not int or not 0 <= value <= CONFIG_LIMITS[key]:
                raise ValueError(f"config.json: {key} must be an integer from 0 to {CONFIG_LIMITS[key]}")
        config = cls(**values)
        if min(config.vocab_size, config.d_model, config.n_layers, config.n_heads, config.d_ff,
               config.max_positions) < 1 or (
                config.d_model % config.n_heads):
            raise ValueError("config.json: sizes must be at least 1, and d_model a multiple of n_heads")
        return config

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
    path = Path(directory) / CONFIG_FILE
    with open(path, "rb") as f:  # bounded: vsnap's validate refuses a bigger config.json
        text = f.read(MAX_CONFIG_BYTES + 1)
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(f"{path} has more than {MAX_CONFIG_BYTES} bytes")
    return TinyConfig.from_dict(json.loads(text))


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


Step = tuple[int, dict[str, float]]  # the chosen token and the top-k logprobs by token id (best first)


@torch.no_grad()
def next_token(model: TinyDecoder, ids: list[int], top_k: int) -> Step:
    """One greedy step: the whole sequence through the model, the last position's top-k."""
    logits = model(torch.tensor([ids]))[0, -1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    values, indices = torch.topk(log_probs, top_k)
    return int(indices[0]), {str(int(i)): float(v) for v, i in zip(values, indices)}


def step(model: TinyDecoder, batch: list[tuple[list[int], int]]) -> list[Step]:
    """One step of each (ids, top_k) in ``batch``, one forward pass each (see the module docstring)."""
    return [next_token(model, ids, top_k) for ids, top_k in batch]


def check_length(prompt_tokens: int, max_tokens: int, max_len: int) -> None:
    if prompt_tokens + max_tokens > max_len:
        raise ValueError(f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) "
                         f"exceeds max_model_len {max_len}")


def generate(model: TinyDecoder, prompt: str, max_tokens: int, top_k: int, max_len: int) -> dict[str, Any]:
    """Greedy decoding; returns the token ids and, per position, the top-k logprobs by token id."""
    ids = encode(prompt)
    check_length(len(ids), max_tokens, max_len)
    tokens: list[int] = []
    logprobs: list[dict[str, float]] = []
    for _ in range(max_tokens):
        chosen, top = next_token(model, ids + tokens, top_k)
        tokens.append(chosen)
        logprobs.append(top)
    return {"token_ids": tokens, "logprobs": logprobs, "prompt_tokens": len(ids)}


class TextStream:
    """Text of a token stream as it grows: a byte that ends a UTF-8 character releases it.

    ``"".join(push(t) for t in tokens) + flush()`` equals ``decode(tokens)``: a streamed answer
    has exactly the non-streamed text; incomplete characters wait for their last byte (or
    become U+FFFD at the end, as ``decode`` makes them).
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(bytes([token])) if token < 256 else ""

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


CHAT_ROLES = ("system", "developer", "user", "assistant")


def chat_prompt(messages: list[tuple[str, str]]) -> str:
    """The chat template: each (role, content) as ``<|role|>\ncontent\n``, then ``<|assistant|>\n``.

    For example ``[("system", "Be brief."), ("user", "Hi")]`` becomes
    ``"<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"``; the completion continues it.
    """
    for role, _ in messages:
        if role not in CHAT_ROLES:
            raise ValueError(f"message role {role!r} is not one of {', '.join(CHAT_ROLES)}")
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"
