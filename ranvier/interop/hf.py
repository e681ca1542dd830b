"""Hugging Face folders: config.json and model.safetensors (or shards with
model.safetensors.index.json; float32, float16 or bfloat16) of a LlamaForCausalLM or a
MixtralForCausalLM (a MoE: router gate and experts' w1/w2/w3). HF rotates the halves of
each head (rotate_half) where llama2.c and ranvier rotate interleaved pairs, so q and k
rows are permuted on the way."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_bytes
from ..errors import brief, is_file_name, name_mismatch, parse_json
from ..models.llama import LlamaConfig
from ..models.moe import MoEConfig
from ..safetensors_file import read_safetensors
from .weights import InteropError, check_weights, config_from, oversized_fields, torch_layout, weight_shapes


def hf_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a torch [out, in] q/k weight from interleaved-pair RoPE order to HF's half-split
    order (transformers' convert_llama_weights_to_hf.py `permute`)."""
    out, inp = w.shape
    return np.ascontiguousarray(w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(0, 2, 1, 3).reshape(out, inp))


def hf_unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `hf_permute`."""
    out, inp = w.shape
    return np.ascontiguousarray(w.reshape(n_heads, 2, out // n_heads // 2, inp).transpose(0, 2, 1, 3).reshape(out, inp))


def hf_config(config: LlamaConfig, bos_id: int = 1, eos_id: int = 2) -> dict:
    if isinstance(config, MoEConfig):
        return _mixtral_config(config, bos_id, eos_id)
    c = config
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.dim,
        "intermediate_size": c.hidden_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": c.shared_classifier,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def _mixtral_config(c: MoEConfig, bos_id: int, eos_id: int) -> dict:
    """MixtralForCausalLM's config. Mixtral has every layer MoE, no shared expert and
    renormalized top-k weights; NTK scaling is written as the rotary base it gives."""
    if c.moe_every != 1 or c.shared_hidden or not c.normalize_top_k:
        raise InteropError("Mixtral has a MoE in every layer, no shared expert and renormalized top-k weights; "
                           f"this model has moe_every={c.moe_every}, shared_hidden={c.shared_hidden}, "
                           f"normalize_top_k={c.normalize_top_k}")
    llama = hf_config(LlamaConfig(**{f: getattr(c, f) for f in LlamaConfig.__dataclass_fields__}), bos_id, eos_id)
    for key in ("attention_bias", "mlp_bias", "rope_scaling"):
        llama.pop(key)
    return {
        **llama,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "rope_theta": c.rope_base,
        "num_local_experts": c.n_experts,
        "num_experts_per_tok": c.top_k,
        "router_aux_loss_coef": c.aux_loss_weight,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def hf_state_dict(config: LlamaConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ranvier weights → HF LlamaForCausalLM (or MixtralForCausalLM) names, torch [out, in]
    layout, q/k rows permuted."""
    c, w = config, check_weights(config, weights)
    state = {"model.embed_tokens.weight": w["tok_embeddings"]}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."

        def lw(name: str, i: int = i) -> np.ndarray:
            return w[f"layers.{i}.{name}"]

        state[p + "input_layernorm.weight"] = lw("attention_norm")
        state[p + "self_attn.q_proj.weight"] = hf_permute(torch_layout(lw("wq")), c.n_heads)
        state[p + "self_attn.k_proj.weight"] = hf_permute(torch_layout(lw("wk")), c.n_kv_heads)
        state[p + "self_attn.v_proj.weight"] = torch_layout(lw("wv"))
        state[p + "self_attn.o_proj.weight"] = torch_layout(lw("wo"))
        state[p + "post_attention_layernorm.weight"] = lw("ffn_norm")
        if isinstance(c, MoEConfig):
            state[p + "block_sparse_moe.gate.weight"] = torch_layout(lw("router"))
            for e in range(c.n_experts):
                for name in ("w1", "w2", "w3"):
                    state[p + f"block_sparse_moe.experts.{e}.{name}.weight"] = torch_layout(lw(f"experts.{name}")[e])
            continue
        state[p + "mlp.gate_proj.weight"] = torch_layout(lw("w1"))
        state[p + "mlp.up_proj.weight"] = torch_layout(lw("w3"))
        state[p + "mlp.down_proj.weight"] = torch_layout(lw("w2"))
    state["model.norm.weight"] = w["norm"]
    if not c.shared_classifier:
        state["lm_head.weight"] = torch_layout(w["output"])
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()}


def export_hf(config: LlamaConfig, weights: dict[str, np.ndarray], out_dir: str | os.PathLike,
              bos_id: int = 1, eos_id: int = 2) -> Path:
    """Write config.json and model.safetensors that transformers' LlamaForCausalLM (or, for a
    MoE, MixtralForCausalLM) loads."""
    from safetensors.numpy import save as st_save

    out = Path(out_dir)
    state = hf_state_dict(config, weights)
    atomic_write_bytes(out / "model.safetensors", st_save(state, metadata={"format": "pt"}))
    atomic_write_bytes(out / "config.json", (json.dumps(hf_config(config, bos_id, eos_id), indent=2) + "\n").encode())
    return out


def _safetensors_files(folder: Path) -> list[Path]:
    """The weight files: those the shard index names, else model.safetensors, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        document = parse_json(index.read_bytes(), InteropError, f"{index} is not valid JSON")
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict):
            raise InteropError(f"{index} is not a safetensors index: it has no 'weight_map' object")
        for name in weight_map.values():
            if not is_file_name(name):
                raise InteropError(f"{index}: weight_map names {brief(name)}, not a file in {folder}")
        files = sorted({folder / name for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise InteropError(f"{file}, named by {index}'s weight_map, is missing")
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InteropError(f"{folder} holds no *.safetensors weights")
    return files


def _check_size(config: LlamaConfig, config_path: Path, files: list[Path]) -> None:
    """Refuse a config.json that needs more weights than its safetensors files hold, before
    anything its sizes describe is built: 2 bytes a parameter at the least (16-bit floats)."""
    available = sum(file.stat().st_size for file in files)

    def fits(c: LlamaConfig) -> bool:
        return 2 * c.parameter_count() <= available

    if not fits(config):
        said = ", ".join(f"{_HF_NAMES[k]} {getattr(config, k):,}" for k in oversized_fields(config, fits))
        raise InteropError(
            f"{config_path}: {said or 'the model'} needs at least {2 * config.parameter_count():,} bytes of weights "
            f"(2 bytes a parameter), but {', '.join(file.name for file in files)} hold {available:,}"
        )


def import_hf(folder: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Read a Hugging Face Llama or Mixtral folder (config.json + safetensors) into ranvier weights."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InteropError(f"{folder} is not a Hugging Face model folder: config.json is missing")
    hf = parse_json(config_path.read_bytes(), InteropError, f"{config_path} is not valid JSON")
    if not isinstance(hf, dict):
        raise InteropError(f"{config_path}: expected a JSON object, not a {type(hf).__name__}")
    config = _config_of(hf, config_path)
    files = _safetensors_files(folder)
    _check_size(config, config_path, files)
    state: dict[str, np.ndarray] = {}
    source: dict[str, Path] = {}
    for file in files:
        tensors = read_safetensors(file.read_bytes(), str(file), InteropError)
        state.update(tensors)
        source.update(dict.fromkeys(tensors, file))
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.shared_classifier:
        state.pop("lm_head.weight", None)
    if isinstance(config, MoEConfig):
        state = _classic_experts(state, config, folder)
    c = config
    names = {"tok_embeddings": ("model.embed_tokens.weight", None), "norm": ("model.norm.weight", None)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        names.update({
            f"layers.{i}.attention_norm": (p + "input_layernorm.weight", None),
            f"layers.{i}.wq": (p + "self_attn.q_proj.weight", c.n_heads),
            f"layers.{i}.wk": (p + "self_attn.k_proj.weight", c.n_kv_heads),
            f"layers.{i}.wv": (p + "self_attn.v_proj.weight", 0),
            f"layers.{i}.wo": (p + "self_attn.o_proj.weight", 0),
            f"layers.{i}.ffn_norm": (p + "post_attention_layernorm.weight", None),
        })
        if isinstance(c, MoEConfig):
            names[f"layers.{i}.router"] = (p + "block_sparse_moe.gate.weight", 0)
            for name in ("w1", "w2", "w3"):
                for e in range(c.n_experts):
                    names[f"layers.{i}.experts.{name}.{e}"] = (p + f"block_sparse_moe.experts.{e}.{name}.weight", 0)
        else:
            names.update({
                f"layers.{i}.w1": (p + "mlp.gate_proj.weight", 0),
                f"layers.{i}.w3": (p + "mlp.up_proj.weight", 0),
                f"layers.{i}.w2": (p + "mlp.down_proj.weight", 0),
            })
    if not c.shared_classifier:
        names["output"] = ("lm_head.weight", 0)
    missing = [hf_name for hf_name, _ in names.values() if hf_name not in state]
    extra = sorted(set(state) - {hf_name for hf_name, _ in names.values()})
    if missing or extra:
        raise InteropError(
            f"{folder}: the weights in {', '.join(file.name for file in files)} do not fit config.json: "
            + name_mismatch(missing, extra)
        )
    shapes = weight_shapes(c)
    weights = {}
    for key, (hf_name, heads) in names.items():
        stacked, _, expert = key.rpartition(".")
        shape = shapes[stacked][1:] if expert.isdigit() else shapes[key]  # one expert of an [E, in, out] weight
        expected = shape[::-1] if heads is not None else shape  # a Linear weight is [out, in]
        if state[hf_name].shape != expected:
            raise InteropError(f"{source.get(hf_name, folder)}: {hf_name} has shape {list(state[hf_name].shape)}, "
                               f"config.json needs {list(expected)}")
        array = np.array(state[hf_name], dtype=np.float32)  # a copy: the file's bytes are not kept
        if heads is not None:  # a Linear weight [out, in]
            if heads:
                array = hf_unpermute(array, heads)
            array = torch_layout(array)
        weights[key] = array
    if isinstance(c, MoEConfig):  # one [E, in, out] array per expert weight
        for i in range(c.n_layers):
            for name in ("w1", "w2", "w3"):
                key = f"layers.{i}.experts.{name}"
                weights[key] = np.stack([weights.pop(f"{key}.{e}") for e in range(c.n_experts)])
    return config, check_weights(config, weights, f"{folder}")


# ranvier's config fields and the config.json keys they come from, which messages name.
_HF_NAMES = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
             "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size", "hidden_dim": "intermediate_size",
             "max_seq_len": "max_position_embeddings", "n_experts": "num_local_experts", "top_k": "num_experts_per_tok"}


def _config_of(hf: dict, config_path: Path) -> LlamaConfig:
    """The ranvier config of a LlamaForCausalLM or MixtralForCausalLM config.json."""
    model_type = hf.get("model_type", "llama")
    if model_type not in ("llama", "mixtral"):
        raise InteropError(f"{config_path}: model_type {brief(model_type)} is not 'llama' or 'mixtral'")
    if hf.get("rope_scaling"):
        raise InteropError(f"{config_path}: rope_scaling {brief(hf['rope_scaling'])} is not supported")
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise InteropError(f"{config_path}: rope_parameters {brief(rope)} is not an object")
    if rope.get("rope_type", "default") != "default":
        raise InteropError(f"{config_path}: rope_type {brief(rope['rope_type'])} is not supported (only 'default')")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise InteropError(f"{config_path}: only silu activations without biases are supported")

    def integer(field: str, default: int | None = None) -> int:
        key = _HF_NAMES[field]
        value = default if hf.get(key) is None else hf[key]
        if value is None:
            raise InteropError(f"{config_path} lacks {key!r}")
        if type(value) is not int or value < 1:  # bool is no size
            raise InteropError(f"{config_path}: {key} {brief(value)} is not a positive integer")
        return value

    def number(key: str, value: object) -> float:
        if type(value) not in (int, float):
            raise InteropError(f"{config_path}: {key} {brief(value)} is not a number")
        return float(value)

    n_heads = integer("n_heads")
    fields = {name: integer(name) for name in ("dim", "n_layers", "vocab_size", "hidden_dim")}
    fields |= {
        "n_heads": n_heads, "n_kv_heads": integer("n_kv_heads", n_heads), "max_seq_len": integer("max_seq_len", 2048),
        "norm_eps": number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": number("rope_theta", hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        "shared_classifier": bool(hf.get("tie_word_embeddings", False)),
    }
    if model_type == "mixtral":
        fields |= {"n_experts": integer("n_experts"), "top_k": integer("top_k"),
                   "aux_loss_weight": number("router_aux_loss_coef", hf.get("router_aux_loss_coef", 0.02))}
    config = config_from(str(config_path), MoEConfig if model_type == "mixtral" else LlamaConfig, **fields)
    if hf.get("head_dim") not in (None, config.head_dim):
        raise InteropError(f"{config_path}: head_dim {brief(hf['head_dim'])} differs from hidden_size / heads = {config.head_dim}")
    return config


def _classic_experts(state: dict[str, np.ndarray], c: MoEConfig, folder: Path) -> dict[str, np.ndarray]:
    """Mixtral's experts as its checkpoints name them (block_sparse_moe.experts.e.w1/w2/w3),
    also from transformers' fused in-memory layout (mlp.experts.gate_up_proj [E, 2H, D],
    down_proj [E, D, H], mlp.gate)."""
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        if p + "mlp.gate.weight" in state:
            state[p + "block_sparse_moe.gate.weight"] = state.pop(p + "mlp.gate.weight")
        gate_up, down = state.pop(p + "mlp.experts.gate_up_proj", None), state.pop(p + "mlp.experts.down_proj", None)
        if gate_up is None or down is None:
            continue
        E, H, D = c.n_experts, c.hidden_dim, c.dim
        if gate_up.shape != (E, 2 * H, D) or down.shape != (E, D, H):
            raise InteropError(f"{folder}: {p}mlp.experts.gate_up_proj {list(gate_up.shape)} and down_proj "
                               f"{list(down.shape)} do not fit config.json ([{E}, {2 * H}, {D}] and [{E}, {D}, {H}])")
        for e in range(c.n_experts):
            expert = f"{p}block_sparse_moe.experts.{e}."
            state[expert + "w1.weight"], state[expert + "w3.weight"] = np.split(np.asarray(gate_up[e]), 2, axis=0)
            state[expert + "w2.weight"] = np.asarray(down[e])
    return state
