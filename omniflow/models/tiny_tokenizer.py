"""A byte-level BPE tokenizer built in code (no download), saved as tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = [PAD, BOS, EOS]
# "role: text</s>" per message, media parts as <image>/<audio> (roles/chat_template.py).
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'audio' %}<audio>{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. To be or not to be, that is the question. All that glitters is not gold.
Pipelines of actors exchange messages over sockets; tensors travel as handles to shared
memory. The engine schedules requests in batches, pages the key-value cache, and samples
tokens one step at a time. Images and audio are encoded into embeddings, and the language
model decodes text, image and audio tokens. Hello world! 0123456789 + - * / = ( ) [ ] { }
How are you today? I am fine, thank you. What time is it? It is half past nine.
Once upon a time there was a small model that learned to count: one two three four five
six seven eight nine ten eleven twelve. Rivers flow to the sea; mountains rise to the sky.
"""


def build_tiny_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a deterministic byte-level BPE with at most `vocab_size` entries."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size {vocab_size} is below the {len(alphabet) + len(SPECIAL_TOKENS)} "
            "entries a byte-level tokenizer needs"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    lines = [line for line in _CORPUS.splitlines() if line]
    tokenizer.train_from_iterator(lines * 4, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def save_tiny_tokenizer(tokenizer: Tokenizer, folder: str | Path) -> None:
    folder = Path(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 1 << 30,
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
