"""Convert a tiny Hugging Face model to GGUF with llama.cpp's own converter.

Run as a child process by engine_peers.py (python _gguf_convert.py LLAMA_CPP_DIR MODEL OUT TYPE),
with the interpreter that has torch and transformers: LLAMA_CPP_DIR is the vendor/llama.cpp
folder of the llama-cpp-python source the peer was built from (its convert_hf_to_gguf.py,
conversion/ and gguf-py/). The tiny tokenizer's BPE pre-tokenizer is one the converter does not
know; the benchmark feeds token ids, never text, so it is recorded as "gpt-2" (the plain
byte-level one) instead of stopping the conversion. The converter imports sentencepiece before it
looks for a tokenizer.model; without that file it now says so first, as it means to, and moves on
to the tokenizer.json the tiny model has.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) != 5:
        raise SystemExit("usage: _gguf_convert.py LLAMA_CPP_DIR MODEL_DIR OUT_GGUF OUTTYPE")
    source, model, out, outtype = sys.argv[1:]
    script = Path(source) / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SystemExit(f"no convert_hf_to_gguf.py in {source}")
    sys.path[:0] = [str(Path(source) / "gguf-py"), source]
    from conversion.base import TextModel  # the vendored converter's package

    known = TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    sentencepiece = TextModel._create_vocab_sentencepiece

    def sentencepiece_vocab(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"no tokenizer.model in {self.dir_model}")
        return sentencepiece(self)

    TextModel.get_vocab_base_pre = pre_tokenizer
    TextModel._create_vocab_sentencepiece = sentencepiece_vocab
    sys.argv = [str(script), model, "--outfile", out, "--outtype", outtype]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
