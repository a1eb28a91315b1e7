"""A tiny random LlamaForCausalLM directory for a real SGLang server on the GPU host.

    python3 bench/gpu/tiny_model.py DIR

Hidden size 128, 2 layers, a 512-token byte-level BPE tokenizer; no weights (the
server runs with --load-format dummy). Needs the ``tokenizers`` package, which
the carried SGLang site has.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = [
        "The quick brown fox jumps over the lazy dog. " * 3,
        "The capital of France is Paris; a probe asks a sampled question.",
        "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    ] * 50
    tok.train_from_iterator(text, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
                    "add_bos_token": True, **special})
    )  # fmt: skip
    (out / "special_tokens_map.json").write_text(json.dumps(special))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": bos, "eos_token_id": tok.token_to_id("</s>"),
        "pad_token_id": tok.token_to_id("<pad>"),
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": config["eos_token_id"]})
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
