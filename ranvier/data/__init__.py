"""Datasets and batching: MNIST (the bundled subset or IDX files), text corpora, tokenizers,
and uint16 token shards (llama2.c's format) for language models."""

from .batches import BatchSampler
from .corpus import CorpusError, corpus_files, iter_documents, read_corpus, stdlib_dir, unigram_entropy
from .mnist import DatasetError, Split, load_bundled, load_idx_dir, read_idx
from .mnist import load as load_mnist
from .shards import ShardError, TokenShards, pretokenize, write_shard
from .tinystories import download_tinystories, iter_stories, pretokenize_tinystories, train_tinystories_vocab
from .tokenizers import (
    ByteTokenizer,
    CharTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    train_sentencepiece,
)

__all__ = [
    "BatchSampler",
    "ByteTokenizer",
    "CharTokenizer",
    "CorpusError",
    "DatasetError",
    "SentencePieceTokenizer",
    "ShardError",
    "Split",
    "TokenShards",
    "Tokenizer",
    "TokenizerError",
    "corpus_files",
    "download_tinystories",
    "iter_documents",
    "iter_stories",
    "load_bundled",
    "load_idx_dir",
    "load_mnist",
    "load_tokenizer",
    "pretokenize",
    "pretokenize_tinystories",
    "read_corpus",
    "read_idx",
    "stdlib_dir",
    "train_sentencepiece",
    "train_tinystories_vocab",
    "unigram_entropy",
    "write_shard",
]
