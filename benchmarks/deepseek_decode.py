"""Decode speed of a tiny DeepSeek (MLA + shared experts) against a tiny Llama of about the same size, in one run
(issue 48).

    python benchmarks/deepseek_decode.py --threads 1 --tokens 64 --rounds 5

Both models are random-weight checkpoints made with transformers as tests/families.py makes them (its `deepseek_v3`
fixture, width 64, 3 layers; a Llama of the same width, layers, heads and vocabulary whose feed-forward width is
chosen so that its weights match the DeepSeek's weights in total), saved as HF directories in a temporary directory and
loaded by llmtrace (CPU, float32). Each round times --tokens greedy decode steps of each model through its KV cache
(the model's forward alone: no tracing, no sampler), the two alternating so that a busy machine slows them alike. The
medians, their ratio, and the ratio per weight (tok/s × weights) are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def decode_tok_s(model, prompt: list[int], tokens: int) -> float:
    import torch

    with torch.inference_mode():
        cache = model.new_cache(len(prompt) + tokens + 1)
        logits = model(torch.tensor([prompt]), cache, 0, last_only=True)
        pos = len(prompt)
        t0 = time.perf_counter()
        for _ in range(tokens):
            nxt = logits.argmax(-1, keepdim=True)  # (1, 1)
            logits = model(nxt, cache, pos, last_only=True)
            pos += 1
        return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from families import FAMILIES, PROMPT_IDS, Family, write_hf_dir

    from llmtrace.checkpoint.load import load_model

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LLMTRACE_HOME"] = str(Path(tmp) / "home")
        ds = FAMILIES["deepseek_v3"]
        write_hf_dir(Path(tmp) / "deepseek", ds)
        deepseek = load_model(str(Path(tmp) / "deepseek"), device="cpu", dtype="float32")
        n_ds = deepseek.model.num_params()
        # a Llama of the same width, layers, heads and vocabulary; its FFN width makes its weights the DeepSeek's
        c = ds.config
        D, L, V = 64, c["num_hidden_layers"], 320
        per_layer_fixed = 4 * D * D + 2 * D  # q, k, v, o (4 heads of 16) and the two norms
        ffn = max(16, round((n_ds - 2 * V * D - D - L * per_layer_fixed) / (3 * D * L)))
        llama_family = Family("llama_bench", "llama", {"num_hidden_layers": L, "num_key_value_heads": 4,
                                                       "intermediate_size": ffn,
                                                       "rope_parameters": {"rope_type": "default",
                                                                           "rope_theta": 10000.0}})
        write_hf_dir(Path(tmp) / "llama", llama_family)
        llama = load_model(str(Path(tmp) / "llama"), device="cpu", dtype="float32")
        n_ll = llama.model.num_params()
        times: dict[str, list[float]] = {"deepseek": [], "llama": []}
        for r in range(args.rounds):
            arms = [("deepseek", deepseek), ("llama", llama)]
            for name, lm in (arms if r % 2 == 0 else arms[::-1]):
                times[name].append(decode_tok_s(lm.model, PROMPT_IDS, args.tokens))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"threads {args.threads}, {args.tokens} decode steps a round, {args.rounds} rounds, torch "
              f"{torch.__version__}")
        print(f"tiny DeepSeek V3 (MLA, 8+1 experts): {n_ds:,} weights, {med['deepseek']:.0f} tok/s "
              f"(rounds: {', '.join(f'{x:.0f}' for x in times['deepseek'])})")
        print(f"tiny Llama (FFN width {ffn}):      {n_ll:,} weights, {med['llama']:.0f} tok/s "
              f"(rounds: {', '.join(f'{x:.0f}' for x in times['llama'])})")
        ratio = med["llama"] / med["deepseek"]
        per_weight = (med["llama"] * n_ll) / (med["deepseek"] * n_ds)
        print(f"Llama / DeepSeek: {ratio:.2f}× the tok/s, {per_weight:.2f}× per weight")


if __name__ == "__main__":
    main()
