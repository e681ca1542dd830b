"""Models in and out of the formats users have: llama2.c checkpoints and tokenizer.bin,
GGUF files, Hugging Face folders, and ranvier's own run directories."""

from .gguf_file import export_gguf, import_gguf
from .hf import export_hf, hf_config, hf_permute, hf_state_dict, hf_unpermute, import_hf
from .llama2c import export_llama2c, import_llama2c
from .runs import load_any, weights_from_run
from .tokenizer_bin import Llama2cTokenizer, export_tokenizer_bin, import_tokenizer_bin, tokenizer_pieces
from .weights import InteropError, check_weights, weight_shapes

__all__ = [
    "InteropError", "Llama2cTokenizer", "check_weights", "export_gguf", "export_hf", "export_llama2c", "export_tokenizer_bin",
    "hf_config", "hf_permute", "hf_state_dict", "hf_unpermute", "import_gguf", "import_hf", "import_llama2c", "import_tokenizer_bin",
    "load_any", "tokenizer_pieces", "weight_shapes", "weights_from_run",
]
