"""Decode speed of a tiny Granite 4.0-H (Mamba2 hybrid) against a tiny Llama of about the same size, in one process.

Both are random-weight transformers models made here (float32), saved as HF directories and loaded by llmtrace; each
generates N tokens greedily after a short prompt, one run of each in turn, repeated, so that the machine's drift
cancels out. Reported: decode tokens per second (median), the parameter counts, and the hybrid's rate per parameter
against Llama's (issue 48: within 1.5x of Llama's path at the same size).

    PYTHONPATH=$PWD python benchmarks/mamba2_decode.py [--tokens 64] [--rounds 5] [--width 256] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _configs(width: int, layers: int) -> dict:
    common = dict(vocab_size=320, hidden_size=width, num_hidden_layers=layers, num_attention_heads=width // 32,
                  num_key_value_heads=width // 64, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    every = ["mamba"] * layers
    for i in range(layers // 4, layers, max(1, layers // 2)):  # about one layer in four attention, as Granite 4.0-H
        every[i] = "attention"
    granite = dict(common, model_type="granitemoehybrid", layer_types=every, mamba_n_heads=width // 32,
                   mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2,
                   num_local_experts=0, intermediate_size=2 * width, shared_intermediate_size=2 * width,
                   embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 32,
                   logits_scaling=4.0, position_embedding_type=None)
    llama = dict(common, model_type="llama", intermediate_size=int(2.75 * width))
    return {"granite_hybrid": granite, "llama": llama}


def _save(fields: dict, path: Path) -> int:
    import transformers
    from tiny import tiny_tokenizer, write_tokenizer  # the tests' tokenizer

    fields = dict(fields)
    model_type = fields.pop("model_type")
    types = fields.get("layer_types")
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(str(path))
    write_tokenizer(path, tiny_tokenizer(320))
    if types:  # the released names, as the converter and real checkpoints write them
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "layer_types": types}))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    from llmtrace.checkpoint.load import load_model
    from llmtrace.run.generate import generate
    from llmtrace.run.sampler import Sampler, SamplerConfig

    out: dict = {"tokens": args.tokens, "rounds": args.rounds, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        models, rates = {}, {}
        for name, fields in _configs(args.width, args.layers).items():
            params = _save(fields, Path(tmp) / name)
            models[name] = load_model(str(Path(tmp) / name), device="cpu", dtype="float32")
            out[name] = {"params": params}
            rates[name] = []
        prompt = [1, 84, 104, 101, 32, 113, 117, 105]
        for _ in range(args.rounds):
            for name, lm in models.items():
                sampler = Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    list(generate(lm, prompt, sampler, args.tokens, (), True, None).tokens)
                rates[name].append(args.tokens / (time.perf_counter() - t0))
    for name, r in rates.items():
        out[name]["tok_s"] = round(statistics.median(r), 1)
        out[name]["tok_s_x_params"] = out[name]["tok_s"] * out[name]["params"]
    g, l = out["granite_hybrid"], out["llama"]
    out["per_param_ratio"] = round(l["tok_s_x_params"] / g["tok_s_x_params"], 2)  # > 1: the hybrid is slower
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
