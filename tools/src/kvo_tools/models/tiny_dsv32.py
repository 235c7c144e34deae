"""Build a tiny random ``DeepseekV32ForCausalLM`` (weights + byte tokenizer), no downloads.

vLLM serves it through its own DeepSeek-V3.2 model class with kvo's sparse MLA backend
(``kvo_vllm.dsa``). The shapes vLLM-CPU insists on are kept: MLA latent 512 + rope 64 (the
cache row is 576 wide), indexer head dim 128 (vLLM's indexer quant block is 128). Everything
else is small: 2 layers, hidden 256, 4 heads, 4 indexer heads, a dense MLP. ``index_topk`` is
small (32 by default) so that on prompts of a few hundred tokens the selection really is
sparse and changes from step to step. ``initializer_range=0.3`` gives the weights enough gain
that the next token depends on the context (a wrong row selected or read changes the output).
float32 weights: pass ``dtype="float32"`` to vLLM (the CPUs here are AVX2/AVX-512 without bf16
speed-ups).

``mtp=True`` adds one multi-token-prediction layer (``model.layers.{N}.*``: a decoder block with
its own indexer plus ``enorm``/``hnorm``/``eh_proj``/``shared_head``; transformers writes none)
and ``num_nextn_predict_layers=1``, so vLLM can run ``speculative_config={"method": "mtp"}``.

Usage: ``python -m kvo_tools.models.tiny_dsv32 PATH [--layers N] [--topk K] [--seed S] [--mtp]``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvo_tools.models.tiny_llama import _byte_level_tokenizer, _save_seeded

MARKER = "kvo_tiny_dsv32.json"
"""Written last; its presence (with matching parameters) means a complete build."""
LATENT_DIM = 512
ROPE_DIM = 64
INDEX_HEAD_DIM = 128


def _parameters(num_layers: int, index_topk: int, seed: int, mtp: bool) -> dict[str, int]:
    return {"num_layers": num_layers, "index_topk": index_topk, "seed": seed, "mtp": int(mtp),
            "format": 1}


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def build_tiny_dsv32(path: str | os.PathLike[str], num_layers: int = 2, index_topk: int = 32,
                     seed: int = 0, mtp: bool = False) -> Path:
    """Write the random model to ``path`` and return the directory.

    Deterministic: the same ``(num_layers, index_topk, seed)`` always gives the same weights;
    an existing complete build with the same parameters is reused.
    """
    _positive_int("num_layers", num_layers)
    _positive_int("index_topk", index_topk)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target = Path(path)
    marker = target / MARKER
    wanted = _parameters(num_layers, index_topk, seed, mtp)
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return target

    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    tokenizer = _byte_level_tokenizer()
    config = DeepseekV32Config(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
        moe_intermediate_size=128, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        first_k_dense_replace=num_layers,  # every layer dense: MoE is not what is tested here
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=128, kv_lora_rank=LATENT_DIM, qk_rope_head_dim=ROPE_DIM,
        qk_nope_head_dim=64, v_head_dim=64, head_dim=64,
        index_topk=index_topk, index_head_dim=INDEX_HEAD_DIM, index_n_heads=4,
        max_position_embeddings=8192, initializer_range=0.3, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    config.architectures = ["DeepseekV32ForCausalLM"]
    _save_seeded(DeepseekV32ForCausalLM, config, seed, tokenizer, target, marker)
    if mtp:
        _add_mtp_layer(target, seed)
    marker.write_text(json.dumps(wanted))
    return target


def _add_mtp_layer(target: Path, seed: int) -> None:
    """Append layer N (N = num_hidden_layers) as DeepSeek's MTP layer, with random weights."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    last = config["num_hidden_layers"]
    config["num_nextn_predict_layers"] = 1
    config["first_k_dense_replace"] = last + 1  # the MTP block's MLP dense like the others
    weights = load_file(str(target / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed + 1)
    source, layer = f"model.layers.{last - 1}.", f"model.layers.{last}."
    for name, value in list(weights.items()):
        if name.startswith(source):  # the block: the last layer's shapes, fresh values
            fresh = (torch.randn(value.shape, generator=generator) * 0.3 if value.dim() >= 2
                     else value.clone())
            weights[layer + name[len(source):]] = fresh.to(value.dtype)
    hidden = config["hidden_size"]
    weights[layer + "enorm.weight"] = torch.ones(hidden)
    weights[layer + "hnorm.weight"] = torch.ones(hidden)
    weights[layer + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.1
    weights[layer + "shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    weights[layer + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    weights[layer + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file({name: value.contiguous() for name, value in weights.items()},
              str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="directory to write the model into")
    parser.add_argument("--layers", type=int, default=2, help="number of layers (default 2)")
    parser.add_argument("--topk", type=int, default=32, help="index_topk (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--mtp", action="store_true", help="add one MTP layer")
    args = parser.parse_args(argv)
    print(build_tiny_dsv32(args.path, num_layers=args.layers, index_topk=args.topk,
                           seed=args.seed, mtp=args.mtp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
