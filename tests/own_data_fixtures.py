"""What a user brings to `flatfsdp train --data`: a small pretrained Hugging Face
Llama with its own BPE tokenizer (trained here with `tokenizers`) in one
folder, and a jsonl of made-up documents. Nothing is downloaded."""

from __future__ import annotations

import json
import random

SUBJECTS = ["the baker", "a river", "the old clock", "my neighbour", "the library", "a small boat", "the garden",
            "the tide", "a lighthouse", "the market"]
VERBS = ["opens", "watches", "counts", "carries", "mends", "follows", "paints", "remembers"]
OBJECTS = ["the morning bread", "seven blue stones", "the quiet harbour", "a box of letters", "the long bridge",
           "every falling leaf", "the northern road", "a jar of honey"]


def documents(count: int, seed: int = 0) -> list[str]:
    """Made-up documents of a few regular sentences: a model can learn them quickly."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
                     for _ in range(rng.randint(2, 6))]
        docs.append(" ".join(s.capitalize() for s in sentences))
    return docs


def write_jsonl(path, docs: list[str], field: str = "text") -> None:
    with open(path, "w") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, field: doc}) + "\n")


def save_tokenizer(folder, docs: list[str], vocab_size: int = 200) -> int:
    """A byte-level BPE trained on ``docs``, saved as a transformers tokenizer
    (tokenizer.json + tokenizer_config.json, EOS "</s>"); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")
    wrapped.save_pretrained(str(folder))
    return len(wrapped)


def save_llama(folder, vocab_size: int, *, positions: int = 64, seed: int = 3) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                      max_position_embeddings=positions, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))


def make_user_setup(root, *, docs: int = 400) -> dict:
    """{"model": folder with weights + tokenizer, "data": jsonl, "docs": the documents}."""
    texts = documents(docs)
    model = root / "llama"
    vocab = save_tokenizer(model, texts)
    save_llama(model, vocab_size=vocab + 8)  # a few spare rows, as real models often have
    data = root / "docs.jsonl"
    write_jsonl(data, texts)
    return {"model": str(model), "data": str(data), "docs": texts, "vocab": vocab}
