"""Write the small, deterministic assets a torchtitan debug run needs (no download).

    python make_assets.py OUT_DIR      # OUT_DIR/tokenizer/{tokenizer.json,tokenizer_config.json}
                                       # OUT_DIR/c4_synthetic/data.json (JSON lines, "text")

torchtitan's own test assets (tests/assets/tokenizer, c4_test) are not in its wheel; these take
their place: a word-level tokenizer of at most 2048 ids (llama3 debugmodel's vocabulary) and
pseudo-text drawn from a fixed-seed generator, so every run sees the same tokens.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"


def _words(n: int, rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: set[str] = set()
    while len(out) < n:
        out.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 8))))
    return sorted(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: make_assets.py OUT_DIR", file=sys.stderr)
        return 2
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(argv[0])
    rng = random.Random(1234)
    words = _words(1500, rng)
    vocab = {tok: i for i, tok in enumerate([UNK, BOS, EOS, *words, ".", ","])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([BOS, EOS])
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    (out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}))
    # A Zipf-like draw, so the loss has something to learn in six steps.
    weights = [1.0 / (i + 1) for i in range(len(words))]
    (out / "c4_synthetic").mkdir(parents=True, exist_ok=True)
    with open(out / "c4_synthetic" / "data.json", "w") as f:
        for _ in range(400):
            n = rng.randint(60, 400)
            text = " ".join(rng.choices(words, weights, k=n)) + " ."
            f.write(json.dumps({"text": text}) + "\n")
    print(f"assets written under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
