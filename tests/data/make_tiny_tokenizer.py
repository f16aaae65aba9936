"""Builds tests/data/tiny_tokenizer/: a small byte-level BPE tokenizer for the tests' tiny random-weight models.

Run once (`python tests/data/make_tiny_tokenizer.py`) and commit the output; the tests never run it. It is laid out
like the default model's converted tokenizer (SmolLM2-135M: tokenizer.json, tokenizer_config.json and
chat_template.jinja; the same ByteLevel pre-tokenizer, decoder and post-processor, which adds no special tokens),
with the same special tokens at the same ids: <|endoftext|> 0, <|im_start|> 1 (bos), <|im_end|> 2 (eos), so the
tiny models' bos_token_id=1 and eos_token_id=2 hold. Its 2,048 ids all lie below the tiny models' vocab (49,152).
It is trained on the short English text below and on the workloads' built-in corpus (engine/**/corpus.py, read as
text when this script runs), so the workloads' prompts tokenize to realistic lengths: the corpus's sentences and
system prompt take 1,117 tokens here and 1,027 with SmolLM2's tokenizer (trained on the text below alone: 2,040,
and the tiny models hold 512 positions); other English takes up to about twice SmolLM2's count. "hi " * 300 is 301 tokens in both (the greetings in the
text below make " hi" one token): tests/app/test_cli.py sizes a prompt that fits the tiny models' context that way.
Building a tiny model needs no conversion of the default model (30-60 s cold).
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_tokenizer")
VOCAB_SIZE = 2048
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# SmolLM2-135M-Instruct's chat template, as transformers 5 saves it (chat_template.jinja).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n"
    "' + message['content'] + '<|im_end|>' + '\n"
    "'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n"
    "' }}{% endif %}"
)

TEXT = """\
The morning was cold and clear, and the river ran fast under the old stone bridge. People walked to work with
their hands in their pockets, and the baker on the corner had already sold half of his bread. A small boat was
tied to the pier, and two children were watching the gulls fight over a piece of fish.

Most people think of a city as a collection of buildings, but a city is really a set of habits. Every day, millions
of small decisions decide where people live, how they travel, what they eat and who they meet. When those habits
change, the city changes with them, often faster than its streets and houses can follow.

Water boils at one hundred degrees Celsius at sea level, but at a lower temperature on a high mountain, because the
air pressure is lower there. This is why cooking pasta takes longer in the mountains, and why climbers carry
special stoves that work in thin air. The same physics explains how a pressure cooker saves time: it raises the
pressure, and with it the temperature at which the water boils.

A computer program is a list of instructions that a machine follows one after another. The instructions are
simple: add two numbers, compare them, copy a value from one place in memory to another, jump to a different part
of the list. What makes programs powerful is not any single instruction but the way thousands of them are combined
into larger pieces, each of which can be understood, tested and reused on its own. A good program reads almost like
a story, and a bad one reads like a puzzle that nobody wanted to solve.

Language models read text as a sequence of tokens. A token may be a whole word, a part of a word or a single
character, and the model predicts the next token from all the tokens before it. To do this quickly, it keeps a cache
of keys and values for every token it has already seen, so that each new step only has to look back instead of
starting again from the beginning. The cache grows with every token, and managing its memory well is one of the
main problems of serving such models to many users at the same time.

History is full of people who changed the world without meaning to. A farmer who kept careful notes about the
weather, a teacher who wrote down the songs of her village, a sailor who drew the coast more accurately than anyone
before him: none of them expected to be remembered, yet their work is still used today by scientists, writers and
travellers who have never heard their names.

Question: What is the capital of France, and why did it become the capital?
Answer: Paris is the capital of France. It grew on an island in the Seine, where a river crossing and a trade route
met, and the kings of France made it the centre of their government more than a thousand years ago.

Question: How many days are there in a leap year?
Answer: A leap year has three hundred and sixty-six days, one more than an ordinary year, because February gets a
twenty-ninth day. Leap years come every four years, except for most years that end a century.

Please write a short summary of the following article, explain the main idea in simple words, and list three
questions that a curious reader might ask after reading it. Keep the answer friendly, concrete and under two hundred
words. If something in the text is unclear, say so instead of guessing.

She opened the letter slowly, as if the paper could still change its mind. It was from her brother, who had left
the town twenty years earlier and had never written since. "I am coming home in the spring," it said, "and I hope
you will still know me." She read it three times, then put it on the kitchen table and went out into the garden,
where the first green leaves were pushing up through the dark, wet earth.

Hi! Hello there. "Hi," she said, "say hi to your brother for me." He waved hi from the boat, and the children
shouted hi, hello and hey back across the water. Hi again; hi from all of us, and thank you for the tea.

Numbers and symbols: 0 1 2 3 4 5 6 7 8 9 10 12 16 24 32 64 100 128 256 512 1024 2048 3.14 2.5% $20 #1 (a) [b] {c}
<tag> a+b=c x*y/z -> => == != <= >= && || :: ; , . ! ? ' " ` ~ @ ^ _ | \\ 2026-12-01 12:30 e.g. i.e. etc.
"""


def _corpus_text() -> str:
    """The string literals of engine/corpus.py (parsed, not imported: the build needs no engine import)."""
    import ast

    import glob

    root = os.path.join(os.path.dirname(OUT), "..", "..")
    path = min(glob.glob(os.path.join(root, "engine", "**", "corpus.py"), recursive=True), key=len)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return "\n".join(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT, _corpus_text()], trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL] == [0, 1, 2]
    assert tok.get_vocab_size() <= VOCAB_SIZE
    os.makedirs(OUT, exist_ok=True)
    tok.save(os.path.join(OUT, "tokenizer.json"))
    config = {"backend": "tokenizers", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "model_max_length": 8192, "pad_token": "<|im_end|>", "tokenizer_class": "TokenizersBackend",
              "unk_token": "<|endoftext|>"}
    with open(os.path.join(OUT, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(os.path.join(OUT, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(CHAT_TEMPLATE)
    print(f"{OUT}: {tok.get_vocab_size()} ids")


if __name__ == "__main__":
    main()
