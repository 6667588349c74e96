"""Decode speed per parameter of the families that remember differently (issue 48), each against Llama's path, in one
process with the arms alternating.

Every arm is a random-weight checkpoint of a few tens of millions of parameters made here with transformers' own
initialisation (`AutoModelForCausalLM.from_config` under a fixed seed), saved as an HF directory in a temporary folder
and loaded by llmtrace (CPU, float32). All have width 512 and 8 layers; the vocabulary is the tests' tiny one (320
ids), so that the layers, not the LM head, hold the weights. Each round times N greedy decode steps of every arm
through its cache (the model's forward alone: no tracing, no sampler; the prefill of the 14-id prompt is not timed),
the arms in turn, their order reversed every other round, so that a busy machine slows all of them alike.

Reported per arm: the median tok/s, the parameters it holds and those a token uses (a mixture of experts runs K of
its E experts: the weights a decode step reads), and the rate per parameter against Llama's,

    ratio = (Llama tok/s × Llama's parameters) / (arm tok/s × arm's parameters used a token)

so 1.0 is Llama's speed per parameter and 1.5 the issue's bound (more is slower). The parameters a token uses are
the stricter reading for a mixture of experts (counted by its total it would look faster than it is).

    PYTHONPATH=$PWD python benchmarks/families_decode.py                     # all arms, 64 steps, 7 rounds, 1 thread
    PYTHONPATH=$PWD python benchmarks/families_decode.py --arms llama,deepseek_v3 --rounds 9 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

D, LAYERS, VOCAB = 512, 8, 320
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_COMMON = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
               max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, pad_token_id=None)
_DEEPSEEK = dict(num_key_value_heads=8, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                 n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=512,
                 intermediate_size=1536, first_k_dense_replace=1, rope_parameters=_ROPE)

# (model_type, config beyond _COMMON, what it is): every arm about 25M parameters a token uses
ARMS = {
    "llama": ("llama", dict(intermediate_size=1536, rope_parameters=_ROPE), "8 heads on 4 KV heads, SwiGLU 1536"),
    "deepseek_v3": ("deepseek_v3", dict(_DEEPSEEK, q_lora_rank=256, n_group=4, topk_group=2,
                                        routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid"),
                    "MLA (q code 256, latent 128, RoPE key 32), layer 0 dense, then 8 experts of 512 (sigmoid, "
                    "best 2 of 4 groups, top 2) + 1 shared"),
    "deepseek_v2": ("deepseek_v2", dict(_DEEPSEEK, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1,
                                        routed_scaling_factor=1.0, norm_topk_prob=False),
                    "V2-Lite's shape: q direct, latent 128, RoPE key 32; 8 experts of 512 (softmax, top 2) + 1 shared"),
    "granite_hybrid": ("granitemoehybrid", dict(
        layer_types=["mamba", "mamba", "mamba", "attention"] * 2, mamba_n_heads=16, mamba_d_head=64,
        mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, num_local_experts=0,
        num_experts_per_tok=0, intermediate_size=1536, shared_intermediate_size=1536, position_embedding_type=None,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=4.0),
        "Granite 4.0-H's dense shape: 6 Mamba2 layers (16 heads × 64, state 64) and 2 attention, shared MLP 1536"),
    "lfm2": ("lfm2", dict(layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv",
                                       "conv"], conv_L_cache=3, norm_eps=1e-6, intermediate_size=2304,
                          block_multiple_of=256, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
                          rope_parameters=_ROPE),
             "6 short convolutions (kernel 3), 2 attention layers; FFN 2304 adjusted to 1536"),
    "gemma4": ("gemma4_text", dict(
        head_dim=64, global_head_dim=128, num_global_key_value_heads=2, attention_k_eq_v=True, num_kv_shared_layers=2,
        sliding_window=128, hidden_size_per_layer_input=64, vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=30.0, use_double_wide_mlp=False, intermediate_size=1536,
        hidden_activation="gelu_pytorch_tanh", layer_types=["sliding_attention"] * 3 + ["full_attention"]
        + ["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={"sliding_attention": _ROPE, "full_attention": {
            "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}),
        "6 sliding (window 128) : 2 global layers (head 128, keys as values); the last 2 share K and V; "
        "per-layer inputs of 64"),
}


def write_arm(path: Path, name: str) -> None:
    """The arm's checkpoint as transformers initialises it (seed 0), with the tests' tiny tokenizer."""
    import torch
    import transformers
    from families import FAMILIES, family_tokenizer
    from tiny import write_tokenizer

    model_type, extra, _ = ARMS[name]
    config = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(str(path))
    if model_type == "gemma4_text":  # released files keep these; transformers folds them into its per-layer config
        saved = json.loads((path / "config.json").read_text())
        keep = {k: extra[k] for k in ("global_head_dim", "num_global_key_value_heads")}
        (path / "config.json").write_text(json.dumps({**saved, **keep}, indent=2))
    write_tokenizer(path, family_tokenizer(FAMILIES["llama"]))


def used_params(lm) -> int:
    """The parameters one token's decode step uses: all of them, but K of E experts in a mixture of experts."""
    from llmtrace.model.moe import active_weights

    c = lm.config
    if not getattr(c, "n_experts", None):
        return lm.model.num_params()
    active, total = active_weights(c, lm.model.declared_weights())
    return lm.model.num_params() - (total - active)


def decode_tok_s(model, prompt: list[int], steps: int) -> tuple[float, float]:
    """steps greedy decode steps after the prompt's prefill (untimed), through the model's cache: tok/s by the wall
    clock and by this thread's CPU time (with one torch thread, the time the steps computed: not the time other
    processes held the core)."""
    import torch

    with torch.inference_mode():
        cache = model.new_cache(len(prompt) + steps + 1)
        logits = model(torch.tensor([prompt]), cache, 0, last_only=True)
        pos = len(prompt)
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            nxt = logits.argmax(-1, keepdim=True)  # (1, 1)
            logits = model(nxt, cache, pos, last_only=True)
            pos += 1
        return steps / (time.perf_counter() - t0), steps / (time.thread_time() - c0)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated; llama is always run")
    ap.add_argument("--steps", type=int, default=64, help="decode steps a round (default 64)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the figures here as well")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)

    import torch

    torch.set_num_threads(args.threads)
    from families import PROMPT_IDS

    from llmtrace.checkpoint.load import load_model

    names = ["llama"] + [a for a in args.arms.split(",") if a != "llama"]
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        sys.exit(f"unknown arm(s) {', '.join(unknown)}; the arms are {', '.join(ARMS)}")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LLMTRACE_HOME"] = str(Path(tmp) / "home")
        models = {}
        for name in names:
            write_arm(Path(tmp) / name, name)
            models[name] = load_model(str(Path(tmp) / name), device="cpu", dtype="float32")
        for lm in models.values():  # one warm-up each
            decode_tok_s(lm.model, PROMPT_IDS, 4)
        rates: dict[str, list[float]] = {n: [] for n in names}
        cpu_rates: dict[str, list[float]] = {n: [] for n in names}
        t_start = time.time()
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                wall, cpu = decode_tok_s(models[name].model, PROMPT_IDS, args.steps)
                rates[name].append(wall)
                cpu_rates[name].append(cpu)
        minutes = (time.time() - t_start) / 60
        held = {n: lm.model.num_params() for n, lm in models.items()}
        used = {n: used_params(lm) for n, lm in models.items()}
    med = {n: statistics.median(v) for n, v in rates.items()}
    cpu_med = {n: statistics.median(v) for n, v in cpu_rates.items()}
    ref, cpu_ref = med["llama"] * used["llama"], cpu_med["llama"] * used["llama"]
    rows = [{"arm": n, "tok_s": round(med[n], 1), "cpu_tok_s": round(cpu_med[n], 1), "params": held[n],
             "params_used": used[n], "per_param_vs_llama": round(ref / (med[n] * used[n]), 3),
             "cpu_per_param_vs_llama": round(cpu_ref / (cpu_med[n] * used[n]), 3),
             "per_round": [round(x, 1) for x in rates[n]], "cpu_per_round": [round(x, 1) for x in cpu_rates[n]],
             "what": ARMS[n][2]} for n in names]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), {args.threads} thread(s); {args.steps} steps × {args.rounds} "
          f"rounds alternating, {minutes:.1f} min; load average {load:.2f} at the end")
    print("per param vs Llama: (Llama tok/s × its parameters) / (arm tok/s × the parameters it uses a token); "
          "wall clock, then CPU time")
    print(f"{'arm':<15} {'tok/s':>7} {'CPU tok/s':>9} {'params':>11} {'used':>11} {'per param':>9} {'by CPU':>7}"
          f"   CPU tok/s per round")
    for row in rows:
        print(f"{row['arm']:<15} {row['tok_s']:7.1f} {row['cpu_tok_s']:9.1f} {row['params']:11,} "
              f"{row['params_used']:11,} {row['per_param_vs_llama']:8.2f}× {row['cpu_per_param_vs_llama']:6.2f}×   "
              f"{' '.join(f'{x:.0f}' for x in row['cpu_per_round'])}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(),
                                               "torch": torch.__version__, "threads": args.threads,
                                               "steps": args.steps, "rounds": args.rounds, "arms": rows}, indent=1))


if __name__ == "__main__":
    main()
