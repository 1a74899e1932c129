#!/usr/bin/env python3
"""Writes a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json) for a GGUF's
byte-level BPE vocabulary, so tools that need one (aiperf's --tokenizer) run without hub
access: the GGUF holds the vocabulary, the merges and the special tokens.

Usage: gguf_tokenizer.py MODEL.gguf OUT_DIR   (needs PyPI's `gguf`)

Only byte-level BPE ("gpt2" models) is handled; the pre-tokenizer follows the GGUF's
tokenizer.ggml.pre: "smollm" splits digits one by one before the GPT-2 split (as SmolLM's
own tokenizer does), "gpt2" is the GPT-2 split alone. Anything else is refused, not guessed.
"""

import json
import os
import sys

from gguf import GGUFReader

CONTROL = 3  # llama.cpp's token type for control (special) tokens


def field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        sys.exit(f"{key} is not in the GGUF")
    return f


def strings(reader, key):
    f = field(reader, key)
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def ints(reader, key):
    f = field(reader, key)
    return [int(f.parts[i][0]) for i in f.data]


def scalar(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.parts[f.data[0]]
    return bytes(value).decode("utf-8") if f.types and f.types[0].name == "STRING" else int(value[0])


def byte_level(**extra):
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True, **extra}


def main(argv):
    if len(argv) != 3:
        sys.exit(__doc__)
    model, out = argv[1], argv[2]
    reader = GGUFReader(model)
    kind = scalar(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        sys.exit(f"{model}: tokenizer.ggml.model is {kind!r}; only byte-level BPE (gpt2) is handled")
    pre = scalar(reader, "tokenizer.ggml.pre", "gpt2")
    if pre == "smollm":
        pre_tokenizer = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level()]}
    elif pre in ("gpt2", "default"):
        pre_tokenizer = byte_level()
    else:
        sys.exit(f"{model}: pre-tokenizer {pre!r} is not handled (smollm, gpt2)")

    tokens = strings(reader, "tokenizer.ggml.tokens")
    types = ints(reader, "tokenizer.ggml.token_type")
    merges = strings(reader, "tokenizer.ggml.merges")
    special = [i for i, t in enumerate(types) if t == CONTROL]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for i in special
        ],
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": byte_level(trim_offsets=False),
        "decoder": byte_level(),
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }
    name = lambda key: tokens[scalar(reader, key)] if reader.fields.get(key) else None
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "model_max_length": scalar(reader, f"{scalar(reader, 'general.architecture')}.context_length", 8192),
        "clean_up_tokenization_spaces": False,
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    print(f"{out}: {len(tokens)} tokens, {len(merges)} merges, {len(special)} special, pre {pre}")


if __name__ == "__main__":
    main(sys.argv)
