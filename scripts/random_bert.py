"""BERT-shaped models of random weights with a small WordPiece tokenizer, written as model directories:
the suite's tiny embedding model and cross-encoder (tests/backend/models.py) and the rerank benchmark's
MiniLM-shaped one (scripts/bench_embedding_stall.py). Random weights give nonsense vectors and scores
at the speed of real ones.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def word_piece_tokenizer(words: tuple[str, ...], max_length: int) -> BertTokenizerFast:
    """BERT's special tokens, these words, the letters and their `##` pieces (a word not in the list is
    spelled letter by letter); a pair joined as BERT joins it, [CLS] A [SEP] B [SEP], B's tokens of type 1."""
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *LETTERS, *".,!?"]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens + [f"##{c}" for c in LETTERS]))}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tokenizer.decoder = decoders.WordPiece()
    return BertTokenizerFast(tokenizer_object=tokenizer, model_max_length=max_length)


def write_random_bert(
    directory: Path, config: BertConfig, words: tuple[str, ...] = (), reranker: bool = False
) -> Path:
    """A BertModel of random weights (seed 0), or with `reranker` a cross-encoder of one label
    (BertForSequenceClassification), saved with `word_piece_tokenizer(words)` as transformers saves
    them. The config's vocab_size is at least the tokenizer's."""
    tokenizer = word_piece_tokenizer(words, config.max_position_embeddings)
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    torch.manual_seed(0)
    if reranker:
        config.num_labels = 1
        model = BertForSequenceClassification(config)
    else:
        model = BertModel(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
