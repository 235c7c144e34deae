"""Build a tiny random Llama (weights + byte-level tokenizer) on local disk, no downloads.

No model weights can be fetched here, so the end-to-end tests, the benchmarks and the demo run
vLLM on a small Llama whose weights are random but fixed by a seed. ``initializer_range=0.3``
makes the weights large enough that the next token depends on the whole context: a wrong or
missing KV block changes the output, so comparing tokens and logprobs is a real check.
The model is deeper than two layers (8 by default) so a layer buffer plan actually reuses
buffers. Weights are float32: the CPUs here have AVX2 only, where vLLM's bf16 attention is
about four times slower; pass ``dtype="float32"`` to vLLM, which otherwise downcasts a float32
checkpoint to bf16 on CPU.

Usage: ``python -m kvo_tools.models.tiny_llama PATH [--layers N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

BOS, EOS = "<s>", "</s>"
HEAD_DIM = 32
"""vLLM's CPU attention supports head sizes 32, 64, 80, ...; 32 keeps the model small."""
MARKER = "kvo_tiny_llama.json"
"""Written last; its presence (with matching parameters) means a complete build."""


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer without merges: one token per byte, plus BOS/EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    vocab[BOS] = len(vocab)
    vocab[EOS] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                       use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS,
                                   clean_up_tokenization_spaces=False)


def _parameters(num_layers: int, seed: int) -> dict[str, int]:
    return {"num_layers": num_layers, "seed": seed, "format": 2}


def build_tiny_llama(path: str | os.PathLike[str], num_layers: int = 8, seed: int = 0) -> Path:
    """Write a random Llama with ``num_layers`` layers to ``path`` and return the directory.

    Deterministic: the same ``(num_layers, seed)`` always gives the same weights. An existing
    complete build with the same parameters is reused, so callers may call this freely.
    """
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target = Path(path)
    marker = target / MARKER
    wanted = _parameters(num_layers, seed)
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return target

    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _byte_level_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=8 * HEAD_DIM,
        intermediate_size=16 * HEAD_DIM,
        num_hidden_layers=num_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=8192,
        initializer_range=0.3,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    _save_seeded(LlamaForCausalLM, config, seed, tokenizer, target, marker)
    marker.write_text(json.dumps(wanted))
    return target


def _save_seeded(model_class: type[PreTrainedModel], config: PretrainedConfig, seed: int,
                 tokenizer: PreTrainedTokenizerFast, target: Path, marker: Path) -> None:
    """Write a float32 ``model_class(config)`` with weights drawn from ``seed`` (the global
    torch generator put back afterwards) and ``tokenizer`` to ``target``, removing the build
    ``marker`` first (a build is complete once its caller writes that again)."""
    import torch

    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    target.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="directory to write the model into")
    parser.add_argument("--layers", type=int, default=8, help="number of layers (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    print(build_tiny_llama(args.path, num_layers=args.layers, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
