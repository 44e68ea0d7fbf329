"""Random-weight checkpoint folders at the real models' shapes (bench/shapes.py), with SmolLM2's tokenizer, for the
benchmarks that start a real engine or server from a folder (bench/serve.py, bench/startup.py)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch

TOKENIZER_SOURCE = "default"  # the embedded SmolLM2-135M GGUF: its tokenizer goes into random-weight folders


HF_MODELS = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


def hf_config(spec, vocab: int):
    """The `transformers` config of a bench/shapes.py spec (Qwen3-MoE or Qwen3-Next), with `vocab` tokens."""
    import transformers

    a, m = spec.attention, spec.moe
    common = dict(
        vocab_size=vocab, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim,
        rms_norm_eps=spec.rms_eps, tie_word_embeddings=spec.tie_embeddings, max_position_embeddings=spec.max_positions,
        num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.expert_dim,
        norm_topk_prob=m.norm_topk, rope_theta=a.rope_theta,
    )
    if spec.family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common)
    if spec.family == "qwen3_next":
        g = spec.gdn
        return transformers.Qwen3NextConfig(
            **common, partial_rotary_factor=a.rotary_dim / a.head_dim, shared_expert_intermediate_size=m.shared_dim,
            linear_num_key_heads=g.num_k_heads, linear_num_value_heads=g.num_v_heads, linear_key_head_dim=g.k_head_dim,
            linear_value_head_dim=g.v_head_dim, linear_conv_kernel_dim=g.conv_kernel,
            layer_types=["full_attention" if layer.mixer == "attention" else "linear_attention"
                         for layer in spec.layers])
    raise SystemExit(f"--shape: no Hugging Face config for family {spec.family!r}")


def random_tensor(name: str, shape: torch.Size, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A bfloat16 tensor scaled like a trained model's, so activations stay unit-sized and routing spreads."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith("dt_bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if name.endswith("A_log"):
        return (torch.rand(shape, generator=gen, device=device) * 0.5).to(torch.bfloat16).cpu()
    std = 1.0 if name.endswith("embed_tokens.weight") else shape[-1] ** -0.5
    return (torch.randn(shape, generator=gen, device=device) * std).to(torch.bfloat16).cpu()


def shard_of(name: str) -> str:
    """Tensors go to one shard per decoder layer, and one for the rest (embedding, final norm, head)."""
    parts = name.split(".")
    return f"layer{int(parts[parts.index('layers') + 1]):03d}" if "layers" in parts else "rest"


def write_tokenizer(folder: Path, source: str | None = None) -> None:
    """SmolLM2's byte-level BPE tokenizer, taken from the embedded GGUF, as tokenizer.json + tokenizer_config.json;
    or copied from `source`, a folder holding those two files (where the package with the GGUF is not installed,
    e.g. on a GPU machine without internet: write them once with `--write-tokenizer DIR` where it is)."""
    if source is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(source) / name, folder / name)
        return
    from strata.model.checkpoint import open_checkpoint
    from strata.model.loader import resolve_model_path

    parts = open_checkpoint(resolve_model_path(TOKENIZER_SOURCE)).tokenizer_parts()
    backend = parts["tokenizer"]
    backend.save(str(folder / "tokenizer.json"))
    token = lambda i: backend.id_to_token(i) if i is not None else None  # noqa: E731
    config = {"bos_token": token(parts["bos_token_id"]), "eos_token": token(parts["eos_token_id"]),
              "add_bos_token": parts["add_bos_token"], "chat_template": parts["chat_template"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_random_checkpoint(spec, vocab: int, folder: Path, device: torch.device, tokenizer: str | None = None) -> None:
    """A safetensors folder at the spec's shape with random bfloat16 weights, written layer by layer (the model
    is built on the meta device for its tensor names and shapes only), then moved into place."""
    import transformers
    from safetensors.torch import save_file

    config = hf_config(spec, vocab)
    model_cls = getattr(transformers, HF_MODELS[spec.family])
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in model_cls(config).named_parameters()}
    shards: dict[str, list[str]] = {}
    for name in shapes:
        shards.setdefault(shard_of(name), []).append(name)
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)
    weight_map, total = {}, 0
    for k, (shard, names) in enumerate(sorted(shards.items())):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_tensor(name, shapes[name], gen, device) for name in names}
        save_file(tensors, str(partial / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
        print(f"  wrote {file} ({shard}, {total / 1e9:.1f} GB so far)", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.architectures = [model_cls.__name__]
    config.save_pretrained(partial)
    write_tokenizer(partial, tokenizer)
    partial.rename(folder)


def same_shape(a, b) -> bool:
    """Whether two specs describe the same computation (what a random checkpoint must reproduce)."""
    keys = ("family", "hidden_size", "vocab_size", "layers", "attention", "moe", "gdn", "tie_embeddings")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def random_checkpoint(args) -> Path:
    """The cached random-weight folder for `--shape/--layers/--vocab`, written first when it is not there."""
    from shapes import shape

    from strata.model.loader import ModelFiles

    spec = replace(shape(args.shape, args.layers), vocab_size=args.vocab)
    folder = Path(args.checkpoint_dir).expanduser() / f"{args.shape}-{spec.num_layers}L-v{args.vocab}"
    if not (folder / "model.safetensors.index.json").exists():
        print(f"writing random {args.shape} weights ({spec.num_layers} layers, vocabulary {args.vocab}) to {folder}")
        device = torch.device(args.device if args.device.startswith("cuda") else "cpu")
        write_random_checkpoint(spec, args.vocab, folder, device, args.tokenizer)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the server's engine gets the memory the random draws held
    got = ModelFiles.open(folder).spec
    if not same_shape(got, spec):
        raise SystemExit(f"{folder} does not hold the {args.shape} shape: read {got}, want {spec}")
    return folder
